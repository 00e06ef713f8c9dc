# Issue 8: the compiled tests of the flat expert head and the prefetch, then m66.sh with the old install's pallas_triton.py from 73e7715 (4578dd1 added mosaic_prefetch_down)
# Issue 8, whichever one-GPU card comes (the H200 is the machine): the op at 1-8 tokens with the down
# launch's zeros gone (70e8ef4) against the commit before (0c6b3b7: only mosaic_fp4.py differs in the op), the two
# installs side by side in one call — per-kernel device time (moe_profile: the zeros kernel present or not), then
# the looped op with the bench's XLA and Triton rows and the copy rate, before / after / before / after.
# Before the call: git show 0c6b3b7:pallas_kernels/moe_gemm/mosaic_fp4.py > .gpu/mosaic_fp4_0c6b3b7.py
. .gpu/hdr.sh
stamp pytest; timeout 90 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py $ROOT/tests/test_kernel_moe_l2_prefetch.py -k "prefetch_equals" 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -4
rm -rf /tmp/site_old && cp -r /tmp/site /tmp/site_old
cp $ROOT/.gpu/mosaic_fp4_0c6b3b7.py /tmp/site_old/dsjax/kernels/moe_gemm/mosaic_fp4.py
cp $ROOT/.gpu/pallas_triton_73e7715.py /tmp/site_old/dsjax/kernels/moe_gemm/pallas_triton.py  # 4578dd1 added an option the old file lacks
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
site(){ [ $1 = old ] && echo /tmp/site_old || echo /tmp/site; }
for v in old new; do
  stamp profile $v; PYTHONPATH=$(site $v) timeout 60 python3 -m dsjax.bench.moe_profile --tokens 1,2,8 --format fp4 --activations fp8 --top 12 --out $OUT/r/profile-$v.json 2>&1 | clean | tail -40
done
for round in 1 2; do for v in old new; do
  [ $SECONDS -gt 470 ] && { stamp skip op $v $round; continue; }
  stamp op $v $round; PYTHONPATH=$(site $v) timeout 85 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,8 --moe-configs '[]' --out $OUT/r/moe-$v-$round.jsonl 2>&1 | clean | grep -v '^{' | tail -3
  python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "us" in d and d.get("impl") in ("pallas", "xla"): print(sys.argv[2], d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), round(d.get("kernel_us") or 0, 1), round(d.get("of_copy_bw") or 0, 3), d.get("copy_GBps"))' $OUT/r/moe-$v-$round.jsonl $v 2>/dev/null
done; done
grep -ho '"copy_GBps": [0-9.]*' $OUT/r/moe-*.jsonl
stamp done; finish
