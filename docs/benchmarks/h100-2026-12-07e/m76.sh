# The GPU-only MoE tests m75's time limit left (l2_prefetch's first: prewait reads the routing's head by default now).
. .gpu/hdr.sh
mapfile -t ids < <(grep l2_prefetch $ROOT/.gpu/rest.txt; grep -v l2_prefetch $ROOT/.gpu/rest.txt)
stamp pytest; timeout 200 python3 -m pytest -q -p no:cacheprovider -rA "${ids[@]/#/$ROOT/}" 2>&1 | grep -v "^E12\|Source Location\|^external\|^$" | grep "PASSED\|FAILED\|ERROR\|passed\|failed" | tee $OUT/r/pytest.log | tail -40
stamp done; finish
