# One call for whichever card comes: on an H200 the owed timings (m63b.sh); on an H100 every test the CPU suite skips,
# at HEAD (m60b.sh: the compiled MoE kernels with the routing program by default, PTX decode, FP8 tensor cores, GPU
# numerics, the other kernel files compiled).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash .gpu/m63b.sh; else bash .gpu/m60b.sh; fi
