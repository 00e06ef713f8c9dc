# Issue 8, seventh session: the default (routing head) timed with the copy rate and xla at 1, 2, 4, 8 tokens, then the
# GPU-only MoE tests the sixth session's time limits left (rest77.txt), one line per test (-v, streamed to the log).
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
stamp op; timeout 150 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs "[{}]" --out $OUT/r/moe.jsonl 2>&1 | clean | grep -v '^{' | tail -2
python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us") or 0, 1), round(d.get("of_copy_bw") or 0, 3), d.get("copy_GBps"), d.get("rel_diff_vs_first_config"))' $OUT/r/moe.jsonl
mapfile -t ids < $ROOT/.gpu/rest77.txt
stamp pytest; timeout $((540 - SECONDS)) python3 -m pytest -v -p no:cacheprovider "${ids[@]/#/$ROOT/}" 2>&1 | clean > $OUT/r/pytest.log
grep -c PASSED $OUT/r/pytest.log; grep "FAILED\|ERROR\|passed\|failed" $OUT/r/pytest.log | tail -8
stamp done; finish
