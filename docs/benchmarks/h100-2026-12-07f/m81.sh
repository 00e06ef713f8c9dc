# Issue 8, seventh session: the routing program at one token too (mosaic_route_kernel; the default runs XLA's map
# there), interleaved A/B rows in the looped op, then the kernels alone. From 2 tokens the two configs are the same.
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
C='[{}, {"mosaic_route_kernel": true}, {}, {"mosaic_route_kernel": true}, {}, {"mosaic_route_kernel": true}]'
stamp op; timeout 150 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1 --moe-configs "$C" --out $OUT/r/moe.jsonl 2>&1 | clean | grep -v '^{' | tail -2
python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "copy_GBps" in d and "us" not in d: print("copy", d["copy_GBps"], d["machine"])
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us") or 0, 1), round(d.get("of_copy_bw") or 0, 3), d.get("rel_diff_vs_first_config"))' $OUT/r/moe.jsonl | uniq
stamp profile; timeout $((270 - SECONDS)) python3 -m dsjax.bench.moe_profile --tokens 1 --format fp4 --activations fp8 --top 10 --configs '[{}, {"mosaic_route_kernel": true}, {}, {"mosaic_route_kernel": true}]' --out $OUT/r/profile.json 2>&1 | clean | tail -40
stamp done; finish
