"""Lower a jitted function for CUDA on this CPU box under an abstract H200 (jax-anchors §8.5)."""

import jax


def lower_for_h200(f, *args):
    """Runs the Pallas lowering (Mosaic GPU: wgmma, SMEM transforms, layout inference; Triton: the TTIR module)
    and returns the StableHLO text holding the kernel's custom call. PTX and the cubin are built later, at XLA
    compile time, by the CUDA plugin."""
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
