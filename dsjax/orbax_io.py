"""dsjax's own checkpoint format: an Orbax directory of the weight tree plus the config that describes it.

Restoring needs no guessing: the config (saved as JSON beside the arrays) rebuilds the abstract tree, and Orbax
fills it. This is what `dsjax convert` writes, so later loads skip safetensors parsing and conversion.
"""

from __future__ import annotations

import json
import os

import jax

from dsjax.config import ModelConfig
from dsjax.errors import CheckpointError
from dsjax.weights import abstract

MARKER = "dsjax_config.json"


def is_orbax_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, MARKER))


def save(path: str, params, cfg: ModelConfig) -> None:
    path = os.path.abspath(path)
    if os.path.exists(path) and os.listdir(path):
        raise CheckpointError(f"{path}: refusing to overwrite a non-empty directory")
    os.makedirs(path, exist_ok=True)
    import orbax.checkpoint as ocp  # here, not at import: loading safetensors never needs orbax

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), params)
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)


def read_config(path: str) -> ModelConfig:
    path = os.path.abspath(path)
    try:
        with open(os.path.join(path, MARKER)) as f:
            raw = json.load(f)
        return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k != "sharding"})
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable {MARKER} ({e})") from None


def restore_params(path: str, cfg: ModelConfig, shardings=None):
    """The weight tree, each array restored straight into its sharding (default: the first device)."""
    target = abstract(cfg)
    if shardings is not None:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    import orbax.checkpoint as ocp  # here, not at import: loading safetensors never needs orbax

    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.join(os.path.abspath(path), "params"), target)
    return jax.tree.map(lambda x: x, params)


def restore(path: str):
    cfg = read_config(path)
    return cfg, restore_params(path, cfg)
