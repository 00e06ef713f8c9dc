"""The public Python surface: `dsjax.load(...) -> Model`, `Model.logits(...)`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import checkpoint, kernel_choice, orbax_io, sharding
from dsjax.assets import BUNDLED, resolve as resolve_model
from dsjax.config import NUMERICS, ModelConfig, PRESETS, load_config, preset, split_kernels
from dsjax.errors import ConfigError, ContextLimitError, InputError
from dsjax.generate import GenerateOptions, Generation, generate, stream
from dsjax.model import forward
from dsjax.params import init_params
from dsjax.weights import nbytes

_RANDOM_INIT_LIMIT = 4 << 30


@functools.partial(jax.jit, static_argnames=("cfg", "positions", "max_seq"))
def _logits(params, token_ids, *, cfg: ModelConfig, positions: tuple[int, ...] | None, max_seq: int):
    return forward(params, cfg, token_ids, positions, max_seq)


@dataclasses.dataclass
class Model:
    """A loaded model: config + weights on devices. Methods validate inputs at the edge, then call pure code."""

    cfg: ModelConfig
    params: object
    source: str = ""
    max_seq_len: int = 4096
    max_batch: int = 8
    mesh: jax.sharding.Mesh | None = None

    def _on_mesh(self):
        """Traces inside see the mesh (sharding.active_mesh); a no-op on one device."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def check_token_ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise InputError(f"token_ids must be a non-empty [batch, seq] array of ints, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"token_ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.cfg.vocab_size)
        if bad.any():
            r, c = map(int, np.argwhere(bad)[0])
            raise InputError(f"token id {int(ids[r, c])} at [{r}, {c}] is out of range [0, {self.cfg.vocab_size})")
        return ids.astype(np.int32)

    def _options(self, max_new_tokens, **kw) -> GenerateOptions:
        if kw.get("num_draft_tokens") is None:
            kw.pop("num_draft_tokens", None)
        stops = kw.pop("stop_token_ids", None)
        stops = (self.cfg.eos_token_id,) if stops is None else tuple(int(t) for t in stops)
        return GenerateOptions(max_new_tokens=max_new_tokens, stop_token_ids=stops, **kw)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, images=None, **kw) -> list[Generation]:
        """Generate for a batch of token-id prompts. Keywords: temperature, top_p, top_k, min_p,
        seed (int or one per prompt), stop_token_ids (default: EOS), logprobs (top-k count), speculative,
        num_draft_tokens, steps_per_dispatch, prefill_chunk, prefill_schedule ("exact", or V4.1's production
        "replay": CED prefill with SWA bounded replay, decoder layers only for the last window of the prompt).

        `images` (V4.1 with a vision tower): one list per prompt of images — encoded bytes, a file path, a
        `data:image/...;base64,` URL or a uint8 [H, W, 3] array — each placing itself where the prompt holds the
        image token (`cfg.image_token_id`, once per image; the chat encoding writes it for image parts). The
        placeholder expands into the image's span; `Generation.tokens` holds the new tokens only."""
        with self._on_mesh():
            gens = generate(self.params, self.cfg, prompts, self._options(max_new_tokens, **kw),
                            max_seq=self.max_seq_len, max_batch=self.max_batch, images=images)
        for g in gens:
            g.stats["kernels"] = self.kernel_choices()
        return gens

    def kernel_choices(self) -> dict[str, list[str]]:
        """The implementation each op ran with, per shape, under this model's `kernels` setting (see
        dsjax.kernel_choice; also logged on the `dsjax.kernels` logger)."""
        mode = f"kernels={self.cfg.kernels} "
        return {op: [c for c in cs if c.startswith(mode)] for op, cs in kernel_choice.choices().items()
                if any(c.startswith(mode) for c in cs)}

    def stream(self, prompts: list[list[int]], max_new_tokens: int, *, images=None, **kw
               ) -> Iterator[list[list[int]]]:
        """Same arguments as `generate`; yields the new tokens of every row once per device dispatch."""
        gen = stream(self.params, self.cfg, prompts, self._options(max_new_tokens, **kw),
                     max_seq=self.max_seq_len, max_batch=self.max_batch, images=images)
        while True:
            with self._on_mesh():
                new = next(gen, None)
            if new is None:
                return
            yield new[0]

    def logits(self, token_ids, positions: Sequence[int] | None = None) -> jax.Array:
        """float32 [b, s, vocab] logits of a full-sequence forward; only `positions` when given."""
        ids = self.check_token_ids(token_ids)
        pos = None
        if positions is not None:
            pos = tuple(int(p) for p in positions)
            if any(p < 0 or p >= ids.shape[1] for p in pos):
                raise InputError(f"positions must lie in [0, {ids.shape[1]}), got {list(pos)}")
        with self._on_mesh():
            return _logits(self.params, jnp.asarray(ids), cfg=self.cfg, positions=pos, max_seq=self.max_seq_len)


def _sizes(cfg: ModelConfig, max_seq_len: int | None, max_batch: int | None) -> dict:
    seq = min(cfg.max_position_embeddings, 4096) if max_seq_len is None else int(max_seq_len)
    batch = 8 if max_batch is None else int(max_batch)
    if not 2 <= seq <= cfg.max_position_embeddings:
        raise ContextLimitError(f"max_seq_len {seq} must lie in [2, {cfg.max_position_embeddings}] for {cfg.name}",
                                cfg.max_position_embeddings)
    if batch < 1:
        raise ConfigError(f"max_batch must be ≥ 1, got {batch}")
    return {"max_seq_len": seq, "max_batch": batch}


DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dsjax", "xla")


def enable_compilation_cache(path: str | None = DEFAULT_COMPILATION_CACHE) -> None:
    """Keep compiled programs on disk so a second process skips compilation (None leaves JAX's setting)."""
    if path is None or jax.config.jax_compilation_cache_dir == path or not jax.config.jax_enable_compilation_cache:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def model_config(path_or_preset: str) -> ModelConfig:
    """A model's config, read without any weights, for everything `load` takes — a checkpoint directory (a
    transformers-layout one without its MTP head, as `load` builds it; one holding only config.json as written),
    an Orbax directory, a bundled checkpoint (`dsjax-small`), a preset — and a config.json file. Why: `dsjax info`
    and `dsjax plan` answer for every name `dsjax generate --model` takes."""
    path = resolve_model(os.fspath(path_or_preset))
    if os.path.isdir(path):
        if orbax_io.is_orbax_dir(path):
            return orbax_io.read_config(path)
        has_weights = any(f.endswith(".safetensors") for f in os.listdir(path))
        return checkpoint.checkpoint_config(path) if has_weights else load_config(path)
    if os.path.isfile(path):
        return load_config(path)
    if path in PRESETS:
        return preset(path)
    raise ConfigError(_not_a_model(path))


def _not_a_model(path: str) -> str:
    return (f"{path!r} is neither a directory, a bundled checkpoint ({', '.join(BUNDLED)}) nor a known preset; "
            f"presets: {', '.join(sorted(PRESETS))}")


def load(path_or_preset: str, *, mesh=None, ep: str = "tp", numerics: str = "reference-bf16",
         kernels: str = "auto", max_seq_len: int | None = None, max_batch: int | None = None, seed: int = 0,
         compilation_cache: str | None = DEFAULT_COMPILATION_CACHE, ignore_vision: bool = False) -> Model:
    """Load a checkpoint directory (official or transformers layout, or a dsjax Orbax directory), a bundled
    checkpoint (`dsjax-small`, trained, ships in the package) or a preset.

    A preset has no released weights here: it gets random weights (seeded), fine for tiny presets and tests.
    `mesh`: a (dp, tp) mesh from `dsjax.make_mesh` (weights land sharded by `sharding.ShardingRules`);
    `ep`: routed experts over the "tp" devices (default) or over "all" devices of the mesh.
    `compilation_cache`: directory of JAX's persistent compilation cache (default ~/.cache/dsjax/xla; None
    leaves JAX's own setting alone).
    `ignore_vision`: load a V4.1 checkpoint without its vision tower (text only; images are then refused).
    """
    enable_compilation_cache(compilation_cache)
    if numerics not in NUMERICS:
        raise ConfigError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
    split_kernels(kernels)
    if mesh is not None and tuple(mesh.axis_names) != sharding.MESH_AXES:
        raise ConfigError(f"mesh axes must be {sharding.MESH_AXES} (use dsjax.make_mesh), got {mesh.axis_names}")
    rules = sharding.rules_for(ep)

    def setup(cfg):
        cfg = cfg.with_numerics(numerics).replace(kernels=kernels, sharding=rules)
        shardings = sharding.param_shardings(cfg, mesh) if mesh is not None else None
        sizes = _sizes(cfg, max_seq_len, max_batch)
        if mesh is not None:
            dp = sharding.axis_size(mesh, rules.mesh_axes("batch"))
            if sizes["max_batch"] % dp:
                raise ConfigError(f"max_batch {sizes['max_batch']} must be a multiple of the data-parallel size {dp}")
        return cfg, shardings, sizes

    path = resolve_model(os.fspath(path_or_preset))
    if os.path.isdir(path):
        if orbax_io.is_orbax_dir(path):
            cfg, shardings, sizes = setup(orbax_io.read_config(path))
            params = orbax_io.restore_params(path, cfg, shardings)
        else:
            cfg, shardings, sizes = setup(checkpoint.checkpoint_config(path))
            params = checkpoint.load_params(path, cfg, shardings=shardings, ignore_vision=ignore_vision)
        return Model(cfg, params, source=path, mesh=mesh, **sizes)
    if path in PRESETS:
        cfg, shardings, sizes = setup(preset(path))
        size = nbytes(cfg)
        if size > _RANDOM_INIT_LIMIT:
            raise ConfigError(f"preset {path!r} needs {size / 2**30:.1f} GiB of weights; random init on the host "
                              f"is limited to {_RANDOM_INIT_LIMIT >> 30} GiB — pass a checkpoint directory")
        if shardings is None:
            params = init_params(cfg, seed)
        else:
            params = jax.tree.map(sharding.put, init_params(cfg, seed, put=np.asarray), shardings)
        return Model(cfg, params, source=f"preset:{path} (random weights, seed {seed})", mesh=mesh, **sizes)
    if os.path.exists(path):
        raise ConfigError(f"{path}: expected a checkpoint directory (config.json + *.safetensors) or an Orbax directory")
    raise ConfigError(_not_a_model(path))
