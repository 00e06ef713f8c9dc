# Issue 8: do the weight reads pace by DRAM pages? Loads-only kernels, stored layout vs tile-major (each step's box contiguous).
. .gpu/hdr.sh
stamp rc; timeout 400 python3 -m dsjax.bench.moe_read_ceiling --tokens 1,2,4,8 --configs '[{}, {"tiled": true}, {"decode": true}, {"tiled": true, "decode": true}, {"stages": 4}, {"tiled": true, "stages": 4}]' --out $OUT/r/rc.jsonl 2>&1 | grep -v "^E1205\|Source Location\|^external\|^$" | tee $OUT/r/rc.log | grep "tokens\|copy\|rror" | head -120
stamp done; finish
