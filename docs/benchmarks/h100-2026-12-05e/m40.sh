# Next session's first call (issue 8): does quad_waits cut the up kernel's registers to <= 128 (4 programs an SM) and pay?
. .gpu/hdr.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $ROOT/.whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
stamp pytest; timeout 120 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "quad" 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -4
for c in '{}' '{"mosaic_quad_waits": true}'; do
  stamp dump "$c"; d=$OUT/r/dump-$(echo "$c" | tr -dc a-z); mkdir -p $d; JAX_ENABLE_COMPILATION_CACHE=false MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$d timeout 100 python3 $ROOT/.gpu/one_op.py 8 1 "$c" > /dev/null 2>&1; cat $d/*.ptxas | grep -i "registers"
done
stamp op; timeout 200 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs '[{"mosaic_quad_waits": true}, {}]' --out $OUT/r/moe.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: continue
    if "us" in d and d.get("impl") == "pallas": print(d.get("tokens"), d.get("options"), round(d["us"], 1), round(d["kernel_us"], 1), round(d["of_copy_bw"], 3))'
stamp ncu; timeout 150 /usr/local/cuda/bin/ncu --kernel-name regex:mosaic --launch-skip 4 --launch-count 1 --section Occupancy --section LaunchStats --section SpeedOfLight python3 $ROOT/.gpu/one_op.py 8 4 '{"mosaic_quad_waits": true}' > $OUT/r/ncu8-quads.txt 2>&1; grep -E "Duration|DRAM Throughput|Registers Per|Block Limit|Achieved Active Warps" $OUT/r/ncu8-quads.txt
stamp profile; timeout 120 python3 -m dsjax.bench.moe_profile --tokens 1,8 --format fp4 --activations fp8 --top 16 --configs '[{}, {"mosaic_quad_waits": true}]' --out $OUT/r/profile.json 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tail -40
stamp done; finish
