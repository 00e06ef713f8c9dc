# Issue 8: mosaic_consumers 2 at 4 and 8 tokens against the default (the first call ran out of time after 1 token).
. .gpu/hdr.sh
C2='"mosaic_consumers": 2'
stamp op; timeout 250 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 8,4 --moe-configs "[{$C2}, {$C2, \"mosaic_stages\": 4}, {}]" --out $OUT/r/moe.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | python3 -c '
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: print(l.rstrip()[:300]); continue
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us", 0), 1), round(d.get("of_copy_bw", 0), 3))'
grep -o '"copy_GBps": [0-9.]*' $OUT/r/moe.jsonl | head -1
stamp done; finish
