"""The XLA flags every test process runs under: conftest sets them for pytest's own processes (and so for every
subprocess that inherits the environment); workers started with a cleaned environment take them from here.

The suite is compile-bound on the 2-core CI machine (backend compile was 217 of 285 s over
tests/test_speculative.py) and runs tiny models, so LLVM's optimisation of the generated CPU code costs more than
it saves: at level 0 that file compiled in 159 s and ran in 252 s (-12%). Every tolerance in the suite stays as it
was; the flag only touches how the CPU code is optimised, never the HLO (fusion, reduction order) it implements.
"""

import os

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def worker_env(extra_flags: str = "", **env) -> dict:
    """os.environ with `env` over it and XLA_FLAGS replaced by the test flags (plus `extra_flags`): a worker that
    sets its own device count must not inherit a user's XLA_FLAGS."""
    return dict(os.environ, **env, XLA_FLAGS=f"{TEST_XLA_FLAGS} {extra_flags}".strip())
