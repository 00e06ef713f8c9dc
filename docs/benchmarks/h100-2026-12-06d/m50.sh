# Issue 8: quad_waits against the default, interleaved, at 1-8 tokens (FP8 and bf16 activations); compiled op tests.
. .gpu/hdr.sh
Q='{"mosaic_quad_waits": true}'
pp(){ python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: continue
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us", 0), 1), round(d.get("of_copy_bw", 0), 3), d.get("rel_diff_vs_first_config"))'; }
for act in fp8 bf16; do
stamp op $act; timeout 200 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations $act --moe-tokens 1,2,4,8 --moe-configs "[$Q, {}, $Q, {}]" --out $OUT/r/moe-$act.jsonl 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | pp
grep -o '"copy_GBps": [0-9.]*' $OUT/r/moe-$act.jsonl | head -1
done
stamp pytest; timeout 150 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "compiled or gpu" 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -4
stamp done; finish
