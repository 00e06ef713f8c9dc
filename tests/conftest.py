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


MAP_LIMIT_SHARE = 0.3   # of vm.max_map_count (65,530 here): clear well before the kernel refuses a mapping


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Every XLA:CPU executable keeps ~3 memory mappings until it is dropped; an xdist worker that compiles
    ~17,000 programs in one session reaches the kernel's vm.max_map_count (65,530) and LLVM segfaults inside
    `backend_compile_and_load` (seen late in full runs, in whichever test compiled next). After a module, when
    the mappings pass 30% of the limit, drop JAX's compiled-program caches (later modules recompile what they
    need)."""
    yield
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return
    if _memory_maps() > MAP_LIMIT_SHARE * limit:
        import gc

        jax.clear_caches()
        gc.collect()
