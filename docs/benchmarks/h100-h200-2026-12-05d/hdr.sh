# Sourced by each device call: stage dsjax as an installed package, helpers to stamp and pack results.
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
rm -rf /tmp/site; mkdir -p /tmp/site $OUT/r   # a warm machine keeps /tmp, and pip --target does not replace an older install
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . > $OUT/r/pip.log 2>&1 || { tail -20 $OUT/r/pip.log; exit 1; }
export PYTHONPATH=/tmp/site
cd /tmp
stamp(){ echo "== $(date -u +%T) $*"; }
(nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; python3 -c 'import jax,sys;print(jax.__version__, jax.devices(), sys.version)') > $OUT/r/env.txt 2>&1
finish(){ cd $OUT && tar czf r.tgz r && rm -rf r; }
