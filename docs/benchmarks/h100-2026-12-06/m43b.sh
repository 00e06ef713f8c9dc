# Issue 8: occupancy of the shared-side quad_waits and quad+stream kernels (ncu), and their registers.
. .gpu/hdr.sh
Q='"mosaic_quad_waits": true'; S='"mosaic_stream_scales": true'
for c in "{$Q}" "{$Q, $S}"; do
  n=$(echo "$c" | tr -dc a-z); stamp ncu "$c"; timeout 45 /usr/local/cuda/bin/ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 2 --section Occupancy --section LaunchStats --section SpeedOfLight python3 $ROOT/.gpu/one_op.py 8 2 "$c" > $OUT/r/ncu8-$n.txt 2>&1; grep -E "Duration|DRAM Throughput|Registers Per|Dynamic Shared|Block Limit Reg|Block Limit Sh|Achieved Active Warps|Theoretical Occ" $OUT/r/ncu8-$n.txt
done
stamp done; finish
