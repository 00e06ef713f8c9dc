# Issue 8: the down launch started early (mosaic_down_prewait: PDL, its expert read and its own weights prefetched
# into L2 before griddepcontrol.wait, the h codes' programs triggering it) — compiled tests, per-kernel time, looped op.
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
rows(){ python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us") or 0, 1), round(d.get("of_copy_bw") or 0, 3), d.get("rel_diff_vs_first_config"))' $1; }
PW='{"mosaic_down_prewait": true}'; PDL='{"mosaic_pdl": true}'
stamp pytest; timeout 100 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_l2_prefetch.py -k "prewait" 2>&1 | clean | tee $OUT/r/pytest.log | tail -4
stamp profile; timeout 70 python3 -m dsjax.bench.moe_profile --tokens 1,2,8 --format fp4 --activations fp8 --top 10 --configs "[{}, $PW, $PDL]" --out $OUT/r/profile.json > $OUT/r/profile.log 2>&1; clean < $OUT/r/profile.log | tail -45
stamp op; timeout 150 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,8 --moe-configs "[{}, $PW, {}, $PW]" --out $OUT/r/moe.jsonl 2>&1 | clean | grep -v '^{' | tail -3; rows $OUT/r/moe.jsonl
grep -ho '"copy_GBps": [0-9.]*' $OUT/r/moe.jsonl | sort -u
stamp done; finish
