. .gpu/hdr.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $ROOT/.whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
NCU=/usr/local/cuda/bin/ncu
stamp ncu8; timeout 200 $NCU --kernel-name regex:mosaic --launch-skip 4 --launch-count 2 --section InstructionStats --section WarpStateStats --print-details all python3 $ROOT/.gpu/one_op.py 8 4 > $OUT/r/ncu8-instr.txt 2>&1; echo rc=$?
grep -v "^E1205\|Source Location\|^external\|^$" $OUT/r/ncu8-instr.txt | sed -n '/body_mosaic/,$p' | head -120
stamp dump; mkdir -p $OUT/r/dump; JAX_ENABLE_COMPILATION_CACHE=false MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$OUT/r/dump timeout 100 python3 $ROOT/.gpu/one_op.py 8 1 > $OUT/r/dump.log 2>&1; echo rc=$?; tail -3 $OUT/r/dump.log; ls -la $OUT/r/dump | head
stamp done; finish
