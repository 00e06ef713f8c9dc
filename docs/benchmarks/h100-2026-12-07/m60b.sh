# Every test the CPU suite skips (compiled kernels, PTX decode, FP8 tensor cores, GPU numerics) on the GPU at HEAD,
# then the other kernel test files compiled, as time allows.
. .gpu/hdr.sh
cp -r $ROOT/tests /tmp/tests
F="-q -p no:cacheprovider -rs"
clean(){ grep -v "^E12\|Source Location\|^external\|^$"; }
stamp gpu-only; timeout 280 python3 -m pytest $F /tmp/tests/test_kernel_moe_gemm_mosaic.py /tmp/tests/test_kernel_moe_gemm.py -k "gpu or compiled" --durations=15 2>&1 | clean | tee $OUT/r/pytest-gpu-only.log | tail -25
stamp small; timeout 60 python3 -m pytest $F /tmp/tests/test_kernel_quant_linear.py /tmp/tests/test_numerics.py /tmp/tests/test_quant.py 2>&1 | clean | tee $OUT/r/pytest-small.log | tail -6
stamp kernels; timeout 100 python3 -m pytest $F /tmp/tests/test_kernel_sparse_mqa.py /tmp/tests/test_kernel_indexer_topk.py /tmp/tests/test_kernel_chunk_attention.py /tmp/tests/test_kernel_mhc_sinkhorn.py /tmp/tests/test_kernel_moe_tile_operands.py /tmp/tests/test_kernel_moe_route_slots.py 2>&1 | clean | tee $OUT/r/pytest-kernels.log | tail -8
stamp done; finish
