# Issue 8 on the H200: (1) the routing default, each row also timed by its kernels alone, (program from 2 tokens) against the XLA routing glue, interleaved;
. .gpu/hdr.sh
R='{"mosaic_route_kernel": false}'
pp(){ python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: continue
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), "looped", round(d["us"], 1), "kernels", round(d.get("kernel_us", 0) or 0, 1), "of copy", round(d.get("of_copy_bw", 0) or 0, 3), round(d.get("kernels_of_copy_bw", 0) or 0, 3), d.get("rel_diff_vs_first_config"))'; }
for TK in 8 1,2,4; do stamp op $TK; timeout 140 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens $TK --moe-configs "[$R, {}, $R]" --out $OUT/r/moe-route.jsonl 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | tail -3; done
pp < $OUT/r/moe-route.jsonl
grep -o '"copy_GBps": [0-9.]*' $OUT/r/moe-route.jsonl | head -1
stamp done; finish
