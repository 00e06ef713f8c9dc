# Issue 8: warp-specialized programs (mosaic_consumers 2 / 4): GPU equality, then the op at 1-8 tokens against the default.
. .gpu/hdr.sh
export DSJAX_TEST_COMPILATION_CACHE=none
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $ROOT/.whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
stamp pytest; timeout 170 python3 -m pytest -q -x -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "consumer" 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -6
C2='"mosaic_consumers": 2'; C4='"mosaic_consumers": 4, "mosaic_quad_waits": true'
stamp op; timeout 300 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs "[{$C2}, {$C2, \"mosaic_stages\": 4}, {$C2, \"mosaic_k_splits\": 2}, {$C4}, {}]" --out $OUT/r/moe.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: print(l.rstrip()[:300]); continue
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us", 0), 1), round(d.get("of_copy_bw", 0), 3))'
grep -o '"copy_GBps": [0-9.]*' $OUT/r/moe.jsonl | head -1
c='{"mosaic_consumers": 2, "mosaic_stages": 4}'
stamp ncu "$c"; timeout 50 /usr/local/cuda/bin/ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 2 --section Occupancy --section LaunchStats --section SpeedOfLight python3 $ROOT/.gpu/one_op.py 8 2 "$c" > $OUT/r/ncu8-c2s4.txt 2>&1; grep -E "Duration|DRAM Throughput|Registers Per|Dynamic Shared|Block Limit Reg|Block Limit Sh|Achieved Active Warps|Theoretical Occ" $OUT/r/ncu8-c2s4.txt
stamp done; finish
