"""The Mosaic GPU interpreter's race detector, asked after a kernel ran in interpret mode (CPU tests)."""


def races_found() -> bool:
    """The race detector's verdict on the last interpreted kernel (private API, jax 0.11.2; False without it)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks import get_races
    except ImportError:
        return False
    return bool(get_races().races_found)


def assert_no_races():
    assert not races_found(), "the interpreter's race detector reported a shared-memory race"


def mosaic_interpret():
    """Mosaic GPU interpret mode with NaN-poisoned buffers and the race detector on."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")


INTERPRET = mosaic_interpret()
