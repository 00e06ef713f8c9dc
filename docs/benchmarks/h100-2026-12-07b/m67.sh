# Issue 8: the down weights pulled into L2 by the up launch (mosaic_prefetch_down, l2_prefetch.py): compiled tests,
# per-kernel device time at 1-2 tokens, the looped op at 1-2 then 4-8 tokens beside the default, XLA and Triton.
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
rows(){ python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us") or 0, 1), round(d.get("of_copy_bw") or 0, 3), d.get("rel_diff_vs_first_config"))' $1; }
P0='{"mosaic_prefetch_down": 0}'; P8='{"mosaic_prefetch_down": 8}'; P12='{"mosaic_prefetch_down": 12}'
stamp pytest; timeout 130 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_l2_prefetch.py 2>&1 | clean | tee $OUT/r/pytest.log | tail -4
stamp profile; timeout 110 python3 -m dsjax.bench.moe_profile --tokens 1,2 --format fp4 --activations fp8 --top 10 --configs "[{}, $P0, $P8, $P12]" --out $OUT/r/profile.json > $OUT/r/profile.log 2>&1; clean < $OUT/r/profile.log | tail -60
stamp op12; timeout 170 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2 --moe-configs "[{}, $P0, $P8, $P12, {}, $P8]" --out $OUT/r/moe12.jsonl 2>&1 | clean | grep -v '^{' | tail -3; rows $OUT/r/moe12.jsonl
stamp op48; timeout 130 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 4,8 --moe-configs "[{}, $P8, {}]" --out $OUT/r/moe48.jsonl 2>&1 | clean | grep -v '^{' | tail -3; rows $OUT/r/moe48.jsonl
grep -ho '"copy_GBps": [0-9.]*' $OUT/r/moe*.jsonl | sort -u
stamp done; finish
