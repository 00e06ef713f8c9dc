"""Shared fixtures: a fresh seed per session, printed so a failure can be replayed (DSJAX_TEST_SEED=...)."""

import os
import secrets

import pytest


@pytest.fixture(scope="session")
def test_seed() -> int:
    seed = int(os.environ.get("DSJAX_TEST_SEED", secrets.randbelow(2**31)))
    print(f"\n[dsjax] test seed {seed} (replay with DSJAX_TEST_SEED={seed})")
    return seed
