"""dsjax.kernels: one folder per op — api.py (contract + selection), reference.py, xla path, Pallas kernels.

Installed as `dsjax.kernels` (see pyproject.toml) so no generic top-level name lands in site-packages.
"""
