# Issue 8: the K split on the up GEMM only (k_splits (up, down)) at 1-4 tokens, beside the default; kernels' profile; GPU op test.
. .gpu/hdr.sh
S2='"mosaic_k_splits": [2, 1]'; S4='"mosaic_k_splits": [4, 1]'
stamp op; timeout 270 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4 --moe-configs "[{$S2}, {$S4}, {$S2, \"mosaic_stages\": 3}, {}]" --out $OUT/r/moe.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: continue
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us", 0), 1), round(d.get("of_copy_bw", 0), 3), d.get("rel_diff_vs_first_config"))'
grep -o '"copy_GBps": [0-9.]*' $OUT/r/moe.jsonl | head -1
stamp profile; timeout 120 python3 -m dsjax.bench.moe_profile --tokens 1,2 --format fp4 --activations fp8 --top 16 --configs "[{}, {$S2}]" --out $OUT/r/profile.json > $OUT/r/profile.log 2>&1; grep -v "^E1205\|Source Location\|^external\|^$" $OUT/r/profile.log | tail -40
stamp pytest; timeout 120 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "test_op_matches_reference and k_splits2" 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -4
stamp done; finish
