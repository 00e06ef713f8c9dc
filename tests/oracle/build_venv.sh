#!/usr/bin/env bash
# Build (idempotently) the oracle venv: CPU torch 2.13.0 + transformers 5.24.* + safetensors + numpy.
#
# Why a separate venv: transformers' DeepseekV4ForCausalLM is our exactness oracle, but the JAX venv must
# never carry torch (and certainly not CUDA torch). tests/oracle/*.py run under this venv as subprocesses
# and exchange .npz files with the JAX tests.
#
# Usage: tests/oracle/build_venv.sh            # venv at $DSJAX_ORACLE_VENV or <repo>/.oracle-venv
# Prints the venv's python path on success. Fast path (< 2 s): nothing is installed when the venv already
# has the right versions (checked via importlib.metadata, without importing torch).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${DSJAX_ORACLE_VENV:-$REPO/.oracle-venv}"
TORCH_VER="2.13.0"
TF_SERIES="5.24"

die() { echo "build_venv.sh: ERROR: $*" >&2; exit 1; }

# Exit 0 iff $1 (a python) has torch==2.13.0 (CPU build), transformers 5.24.*, safetensors and numpy.
check() {
  "$1" - "$TORCH_VER" "$TF_SERIES" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md
torch_ver, tf_series = sys.argv[1], sys.argv[2]
try:
    t = md.version("torch"); tf = md.version("transformers"); md.version("safetensors"); md.version("numpy")
except md.PackageNotFoundError:
    sys.exit(1)
base, _, local = t.partition("+")
ok = base == torch_ver and local in ("", "cpu") and not any(
    d.metadata["Name"].lower().startswith("nvidia-") for d in md.distributions())
sys.exit(0 if ok and (tf == tf_series or tf.startswith(tf_series + ".")) else 1)
EOF
}

if [[ -x "$VENV/bin/python" ]] && check "$VENV/bin/python"; then
  echo "$VENV/bin/python"
  exit 0
fi

PY=""
if [[ -x /root/.pyenv/versions/3.11.7/bin/python3.11 ]]; then
  PY=/root/.pyenv/versions/3.11.7/bin/python3.11
elif command -v python3.11 >/dev/null 2>&1; then
  PY="$(command -v python3.11)"
elif command -v python3 >/dev/null 2>&1 && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  PY="$(command -v python3)"
else
  die "no Python 3.11 found (tried /root/.pyenv/versions/3.11.7/bin/python3.11, python3.11, python3)"
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "build_venv.sh: creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV" || die "'$PY -m venv $VENV' failed"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# Through uv where the main venv has run tools/fast_install.py (make venv; ~9 s instead of ~37 s), else pip.
# fast_install itself honours DSJAX_NO_UV (pip, with the same arguments as above).
if [[ -x "$REPO/.venv/bin/uv" ]]; then
  PIP=("$REPO/.venv/bin/python" "$REPO/tools/fast_install.py" "$VENV/bin/python")
fi
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
# torch alone first, so that nothing later can swap in a CUDA build as a dependency
echo "build_venv.sh: installing torch==$TORCH_VER (CPU) ..." >&2
"${PIP[@]}" "torch==$TORCH_VER" >"$LOG" 2>&1 || { cat "$LOG" >&2; die "pip install torch==$TORCH_VER failed"; }
echo "build_venv.sh: installing transformers==$TF_SERIES.* safetensors numpy ..." >&2
"${PIP[@]}" "torch==$TORCH_VER" "transformers==$TF_SERIES.*" safetensors numpy >"$LOG" 2>&1 \
  || { cat "$LOG" >&2; die "pip install transformers/safetensors/numpy failed"; }
check "$VENV/bin/python" || die "venv $VENV still lacks torch==$TORCH_VER (CPU, no nvidia-* packages) / transformers==$TF_SERIES.*"
echo "$VENV/bin/python"
