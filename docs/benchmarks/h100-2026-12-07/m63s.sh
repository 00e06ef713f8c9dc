# The owed H200 figures in the least device time: the routing default at 1-8 tokens, with the bench's XLA and
# Triton rows and the copy rate of the same run.
. .gpu/hdr.sh
stamp op; timeout 190 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs '[{}]' --out $OUT/r/moe-default.jsonl 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | grep -v '^{' | tail -3
python3 -c '
import json
for l in open("'$OUT'/r/moe-default.jsonl"):
    d = json.loads(l)
    if "us" in d: print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us", 0) or 0, 1), round(d.get("of_copy_bw", 0) or 0, 3), d.get("copy_GBps"))'
stamp done; finish
