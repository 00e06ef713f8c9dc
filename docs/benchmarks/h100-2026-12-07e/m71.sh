# Issue 8: the routing program with 1 and 2 warps (it was timed at 4, 8, 16: ~5.5 µs at 8 tokens whatever the warps).
. .gpu/hdr.sh
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
W1='{"mosaic_route_warps": 1}'; W2='{"mosaic_route_warps": 2}'
stamp pytest; timeout 40 python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/test_kernel_moe_route_slots.py::test_compiled_kernel_equals_xla_form_on_gpu[1-8-1]" "$ROOT/tests/test_kernel_moe_route_slots.py::test_compiled_kernel_equals_xla_form_on_gpu[1-8-2]" "$ROOT/tests/test_kernel_moe_route_slots.py::test_compiled_kernel_equals_xla_form_on_gpu[8-8-1]" "$ROOT/tests/test_kernel_moe_route_slots.py::test_compiled_kernel_equals_xla_form_on_gpu[8-8-2]" "$ROOT/tests/test_kernel_moe_route_slots.py::test_compiled_kernel_equals_xla_form_on_gpu[10-24-1]" "$ROOT/tests/test_kernel_moe_route_slots.py::test_compiled_kernel_equals_xla_form_on_gpu[10-24-2]" 2>&1 | clean | tee $OUT/r/pytest.log | tail -3
stamp profile; timeout 50 python3 -m dsjax.bench.moe_profile --tokens 2,4,8 --format fp4 --activations fp8 --top 6 --configs "[{}, $W1, $W2]" --out $OUT/r/profile.json > $OUT/r/profile.log 2>&1; clean < $OUT/r/profile.log | grep -A3 "tokens"
stamp done; finish
