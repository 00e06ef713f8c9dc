# Issue 8: quad_waits (92 regs) with 1 KB less smem (4 up programs an SM?) and stream_scales (5?): op timing, registers, smem, GPU tests, occupancy.
. .gpu/hdr.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $ROOT/.whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
Q='"mosaic_quad_waits": true'; S='"mosaic_stream_scales": true'
stamp op; timeout 230 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs "[{$Q}, {$Q, $S}, {}]" --out $OUT/r/moe.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: continue
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us", 0), 1), round(d.get("of_copy_bw", 0), 3))'
grep -o '"copy_GBps": [0-9.]*' $OUT/r/moe.jsonl | head -1
stamp pytest; timeout 120 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "equal_the_default_on_gpu or streamed" 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -4
stamp done; finish
