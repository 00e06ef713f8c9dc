"""dsjax: DeepSeek-V4-family inference in JAX."""

from dsjax.api import Model, load
from dsjax.config import ModelConfig, load_config, preset
from dsjax.errors import CheckpointError, ConfigError, DsjaxError, InputError

__version__ = "0.1.0"
__all__ = ["load", "Model", "ModelConfig", "load_config", "preset", "DsjaxError", "ConfigError",
           "CheckpointError", "InputError", "__version__"]
