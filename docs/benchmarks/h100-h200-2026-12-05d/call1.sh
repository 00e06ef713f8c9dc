. .gpu/hdr.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $ROOT/.whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
stamp pytest; timeout 170 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "early_sums or (compiled and 1-None-False-0)" 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -25
stamp op; timeout 380 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs '[{}, {"mosaic_early_sums": true}, {"mosaic_pdl": true}, {"mosaic_early_sums": true, "mosaic_pdl": true}]' --out $OUT/r/moe.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/moe.log | python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: print(l.rstrip()[:300]); continue
    if "us" not in d: print(str(d)[:300]); continue
    print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), d.get("kernel_us") and round(d["kernel_us"], 1), round(d["of_copy_bw"], 3), d.get("kernels_of_copy_bw") and round(d["kernels_of_copy_bw"], 3), d.get("rel_diff_vs_first_config"))'
stamp done; finish
