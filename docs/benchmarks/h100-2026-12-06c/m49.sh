# Issue 8: the K-split op cases (now D = I = 512, splits asserted) compiled.
. .gpu/hdr.sh
stamp pytest; timeout 200 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_gemm_mosaic.py -k "test_op_matches_reference" 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/pytest-split.log | tail -4
stamp done; finish
