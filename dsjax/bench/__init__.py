"""Benchmarks: scripts that print and save figures with their method (never timed tests)."""
