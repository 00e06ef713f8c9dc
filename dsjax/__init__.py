"""dsjax: DeepSeek-V4-family inference in JAX."""

from dsjax.api import Model, load
from dsjax.checkpoint import save_checkpoint
from dsjax.config import ModelConfig, load_config, preset
from dsjax.errors import CheckpointError, ConfigError, DsjaxError, InputError
from dsjax.sharding import make_mesh

__version__ = "0.1.0"
__all__ = ["load", "save_checkpoint", "Model", "ModelConfig", "load_config", "preset", "DsjaxError", "ConfigError",
           "CheckpointError", "InputError", "make_mesh", "__version__"]
