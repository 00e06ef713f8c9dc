# Sourced by each device call: stage dsjax as an installed package, helpers to stamp and pack results.
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
rm -rf /tmp/site; mkdir -p /tmp/site $OUT/r   # a warm machine keeps /tmp, and pip --target does not replace an older install
# pyproject's SPDX license string needs setuptools >= 77; an older one there gets a copy with the old table form
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . > $OUT/r/pip.log 2>&1 || {
  rm -rf /tmp/src /tmp/site && mkdir -p /tmp/site && cp -r $ROOT /tmp/src && sed -i 's/^license = "Apache-2.0"/license = {text = "Apache-2.0"}/; /^license-files/d' /tmp/src/pyproject.toml
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site /tmp/src >> $OUT/r/pip.log 2>&1 || { tail -20 $OUT/r/pip.log; exit 1; }; }
export PYTHONPATH=/tmp/site
cd /tmp
stamp(){ echo "== $(date -u +%T) $*"; }
(nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; python3 -c 'import jax,sys,setuptools;print(jax.__version__, jax.devices(), sys.version, "setuptools", setuptools.__version__)') > $OUT/r/env.txt 2>&1
finish(){ cd $OUT && tar czf r.tgz r && rm -rf r; }
