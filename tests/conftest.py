"""Shared fixtures: a fresh seed per session, printed so a failure can be replayed (DSJAX_TEST_SEED=...).

The persistent compilation cache stays off inside the test process (dsjax.load would turn it on): tests measure
cold compiles, and a cache write must never be part of what a test exercises. tests/test_startup.py checks the
cache itself, in subprocesses.
"""

import os
import secrets

import jax
import pytest

jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def test_seed() -> int:
    seed = int(os.environ.get("DSJAX_TEST_SEED", secrets.randbelow(2**31)))
    print(f"\n[dsjax] test seed {seed} (replay with DSJAX_TEST_SEED={seed})")
    return seed
