# Issue 8: which source lines the one-token call's small kernels come from (for folding them), FP8 activations.
. .gpu/hdr.sh
stamp profile; timeout 200 python3 -m dsjax.bench.moe_profile --tokens 1,2 --format fp4 --activations fp8 --top 16 --dump /tmp/moe-dump --out $OUT/r/profile-sources.json > $OUT/r/profile-sources.log 2>&1; grep -v "^E1205\|Source Location\|^external\|^$" $OUT/r/profile-sources.log | tail -40
mkdir -p $OUT/r/hlo; ls /tmp/moe-dump | grep -i "after_optimizations.txt" | head -5; for f in $(ls /tmp/moe-dump/*after_optimizations.txt 2>/dev/null | head -4); do gzip -c $f > $OUT/r/hlo/$(basename $f).gz; done
stamp done; finish
