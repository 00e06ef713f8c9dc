# Issue 8: the routing glue's variants — XLA form (default), XLA form with fewer reduction levels (.gpu/route_v2.py),
# the routing program (flat offsets) at 4 / 8 / 16 warps — timed looped and profiled, 1-8 tokens; compiled route tests.
. .gpu/hdr.sh
export ROOT
stamp pytest-route; timeout 120 python3 -m pytest -q -p no:cacheprovider $ROOT/tests/test_kernel_moe_route_slots.py $ROOT/tests/test_kernel_moe_tile_operands.py 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | tee $OUT/r/pytest-route.log | tail -3
stamp time; timeout 240 python3 $ROOT/.gpu/route_glue.py time 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | tee $OUT/r/time.jsonl
stamp profile; timeout 150 python3 $ROOT/.gpu/route_glue.py profile 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" > $OUT/r/profile.jsonl; cut -c1-400 $OUT/r/profile.jsonl
stamp done; finish
