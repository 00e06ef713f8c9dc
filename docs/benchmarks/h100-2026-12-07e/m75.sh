# Issue 8: the new default (the routing's expert head) — the MoE op files' GPU-only tests compiled, then the op at
# 1, 2, 4, 8 tokens (default only, twice) with the copy rate and the xla path.
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
T=$ROOT/tests
stamp pytest; timeout 260 python3 -m pytest -q -p no:cacheprovider $T/test_kernel_moe_gemm_mosaic.py $T/test_kernel_moe_l2_prefetch.py $T/test_kernel_moe_route_slots.py -k "gpu or compiled" 2>&1 | clean | tee $OUT/r/pytest.log | tail -4
stamp op; timeout 130 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs "[{}]" --out $OUT/r/moe.jsonl 2>&1 | clean | grep -v '^{' | tail -2
python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us") or 0, 1), round(d.get("of_copy_bw") or 0, 3), d.get("rel_diff_vs_first_config"))' $OUT/r/moe.jsonl
stamp done; finish
