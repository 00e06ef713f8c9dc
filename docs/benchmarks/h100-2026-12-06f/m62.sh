# Issue 8: the routing program with flat offsets against the default XLA routing glue, interleaved, on the bench.
. .gpu/hdr.sh
R='{"mosaic_route_kernel": true}'
pp(){ python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: continue
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us", 0), 1), round(d.get("of_copy_bw", 0), 3), d.get("rel_diff_vs_first_config"))'; }
stamp op; timeout 280 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs "[$R, {}, $R]" --out $OUT/r/moe-route.jsonl 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | pp
grep -o '"copy_GBps": [0-9.]*' $OUT/r/moe-route.jsonl | head -1
stamp done; finish
