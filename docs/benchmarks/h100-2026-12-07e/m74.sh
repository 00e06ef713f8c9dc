# Issue 8 (the session's last device minutes): mosaic_route_head (the kernels' expert rows from the routing, no pad
# kernel) — compiled tests, then the looped op beside the default in one process, then per-kernel time.
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
T=$ROOT/tests
H='{"mosaic_route_head": true}'; RH='{"mosaic_route_head": true, "mosaic_route_kernel": true}'
stamp pytest; timeout 80 python3 -m pytest -q -p no:cacheprovider $T/test_kernel_moe_route_slots.py $T/test_kernel_moe_gemm_mosaic.py -k "(compiled_kernel_equals and not -8] and not -16] and not -2]) or routing_head or no_pair_weights" 2>&1 | clean | tee $OUT/r/pytest.log | tail -3
stamp op; timeout 140 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs "[{}, $H, $RH, {}, $H]" --out $OUT/r/moe.jsonl 2>&1 | clean | grep -v '^{' | tail -2
python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us") or 0, 1), round(d.get("of_copy_bw") or 0, 3), d.get("copy_GBps"), d.get("rel_diff_vs_first_config"))' $OUT/r/moe.jsonl
[ $SECONDS -lt 260 ] && { stamp profile; timeout 40 python3 -m dsjax.bench.moe_profile --tokens 1,8 --format fp4 --activations fp8 --top 10 --configs "[{}, $H, $RH]" --out $OUT/r/profile.json > $OUT/r/profile.log 2>&1; python3 - $OUT/r/profile.json <<'PY'
import json, sys
for p in json.load(open(sys.argv[1]))["profiles"]:
    print(p["tokens"], p["options"], round(p["us_per_call"], 1), {k: round(v, 2) for k, v in p["kernels"].items()})
PY
}
stamp done; finish
