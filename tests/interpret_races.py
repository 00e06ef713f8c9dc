"""The Mosaic GPU interpreter's race detector, asked after a kernel ran in interpret mode (CPU tests)."""


def assert_no_races():
    try:   # private API (jax 0.11.2): the race detector's verdict on the last interpreted kernel
        from jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks import get_races
    except ImportError:
        return
    assert not get_races().races_found, "the interpreter's race detector reported a shared-memory race"


def mosaic_interpret():
    """Mosaic GPU interpret mode with NaN-poisoned buffers and the race detector on."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")


INTERPRET = mosaic_interpret()
