. .gpu/hdr.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $ROOT/.whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
stamp tools; which ncu nsys compute-sanitizer; ls -d /usr/local/cuda*/bin 2>/dev/null; ls /usr/local/cuda*/bin 2>/dev/null | grep -i "ncu\|nsys" | head
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "NCU=$NCU"
if [ -n "$NCU" ]; then
  for n in 1 8; do
    stamp ncu $n; timeout 200 $NCU --kernel-name regex:mosaic --launch-skip 4 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats python3 $ROOT/.gpu/one_op.py $n 4 > $OUT/r/ncu$n.txt 2>&1; echo rc=$?
    grep -v "^E1205\|Source Location\|^external\|^$" $OUT/r/ncu$n.txt | grep -i "==PROF==\|error\|body\|Duration\|Throughput\|Stall\|Warp Cycles\|Issued\|Eligible\|Active Warps\|Occupancy\|Registers\|Shared Memory\|Block Size\|Grid Size\|L2 Hit\|Waves" | head -60
  done
fi
stamp done; finish
