"""dsjax's own checkpoint format: an Orbax directory of the weight tree plus the config that describes it.

Restoring needs no guessing: the config (saved as JSON beside the arrays) rebuilds the abstract tree, and Orbax
fills it. This is what `dsjax convert` writes, so later loads skip safetensors parsing and conversion.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp

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
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), params)
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)


def restore(path: str):
    path = os.path.abspath(path)
    try:
        with open(os.path.join(path, MARKER)) as f:
            raw = json.load(f)
        cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable {MARKER} ({e})") from None
    target = abstract(cfg)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.join(path, "params"), target)
    return cfg, jax.tree.map(lambda x: x, params)
