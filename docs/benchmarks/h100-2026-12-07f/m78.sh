# Issue 8, seventh session, call 2: the route-slots program compiled (15 cases) and test_kernel_moe_gemm.py's GPU-only
# tests (the Triton kernels, PTX decode, FP8 MMA) under the current default, one line per test.
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
T=$ROOT/tests
stamp pytest; timeout $((560 - SECONDS)) python3 -m pytest -v -p no:cacheprovider $T/test_kernel_moe_route_slots.py $T/test_kernel_moe_gemm.py -k "gpu or compiled" 2>&1 | clean > $OUT/r/pytest2.log
grep -c PASSED $OUT/r/pytest2.log; grep "FAILED\|ERROR\|passed\|failed" $OUT/r/pytest2.log | tail -8
stamp done; finish
