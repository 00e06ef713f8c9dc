"""The mesh and the one table of sharding rules: logical axis names (weights.py's `ArrayInfo.axes`) -> mesh axes.

The mesh always has two axes, `dp` (batch slots) and `tp` (tensor parallel); either may have size 1. Decode runs
with replicated activations, sharded weights and an all-reduce after each row-parallel matmul: query heads,
`wo_a` groups, sinks and indexer heads split over `tp`; the KV latent, compressors, norms and the small
projections are replicated; routed experts split over the `ep` axes (by default `tp`; `("dp", "tp")` puts
experts on every device, attention then being data-parallel); the shared expert is tensor-parallel; embedding
and head are vocab-parallel.

The rules live in `ModelConfig.sharding` (static, hashed into every compile) and the mesh in JAX's context
(`jax.set_mesh`), so model code asks `active_mesh()` and stays a pure function of (params, cfg, inputs).
Without a mesh every helper here is the identity.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsjax.errors import ConfigError

MESH_AXES = ("dp", "tp")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axes (a tuple; () = replicated). Changing the strategy means editing this table."""

    batch: tuple[str, ...] = ("dp",)
    heads: tuple[str, ...] = ("tp",)        # query heads, wo_a groups, attention sinks, wo_b input
    index_heads: tuple[str, ...] = ("tp",)  # lightning-indexer heads (their scores are summed across shards)
    experts: tuple[str, ...] = ("tp",)      # routed experts (EP): local-expert mask + psum
    moe_ffn: tuple[str, ...] = ()           # inside one routed expert
    ffn: tuple[str, ...] = ("tp",)          # the shared expert's hidden dim
    vocab: tuple[str, ...] = ("tp",)        # embedding rows and head rows
    engram_rows: tuple[str, ...] = ("tp",)  # V4.1 Engram table rows (looked up per shard + psum)

    def mesh_axes(self, logical: Optional[str]) -> tuple[str, ...]:
        if logical is None:
            return ()
        if not hasattr(self, logical):
            raise ConfigError(f"no sharding rule for logical axis {logical!r}")
        return tuple(getattr(self, logical))

    def spec(self, axes: Sequence[Optional[str]]) -> P:
        """PartitionSpec of an array whose dimensions carry these logical axes; a mesh axis is used once."""
        parts, used = [], set()
        for logical in axes:
            mesh_axes = tuple(a for a in self.mesh_axes(logical) if a not in used)
            used.update(mesh_axes)
            parts.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        return P(*parts)


def rules_for(ep: str = "tp") -> ShardingRules:
    """`ep="tp"`: experts over the tp devices (default); `ep="all"`: over every device of the mesh."""
    if ep == "tp":
        return ShardingRules()
    if ep == "all":
        return ShardingRules(experts=("dp", "tp"))
    raise ConfigError(f"ep must be 'tp' or 'all', got {ep!r}")


def make_mesh(tp: int = 1, dp: int = 1, devices: Sequence | None = None) -> Mesh:
    """A (dp, tp) mesh over the first dp*tp devices (all processes' devices in a multi-host run)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp < 1 or dp < 1:
        raise ConfigError(f"tp and dp must be ≥ 1, got tp={tp} dp={dp}")
    if dp * tp > len(devices):
        raise ConfigError(f"a {dp}x{tp} (dp x tp) mesh needs {dp * tp} devices; {len(devices)} are visible")
    grid = np.asarray(devices[:dp * tp], dtype=object).reshape(dp, tp)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def active_mesh():
    """The mesh set by `jax.set_mesh` (an AbstractMesh while tracing), or None on a single device."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or math.prod(mesh.axis_sizes) == 1 else mesh


def axis_size(mesh, axes: Sequence[str]) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(sizes[a] for a in axes)


def local_ids(ids, axes: Sequence[str], n_local: int):
    """Inside shard_map, over a dimension split in blocks of `n_local` along `axes`: (ids shifted to this shard and
    clipped into it, which of them it holds). The embedding and the experts both look up rows this way."""
    shifted = ids - jax.lax.axis_index(tuple(axes)) * n_local
    return jnp.clip(shifted, 0, n_local - 1), (shifted >= 0) & (shifted < n_local)


def constrain(x, rules: ShardingRules, axes: Sequence[Optional[str]]):
    """`with_sharding_constraint` by logical axes under a mesh; the identity without one."""
    if active_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, rules.spec(axes))


def gather_vocab(logits, rules: ShardingRules):
    """Logits [B, ..., V] whole on every device of a row's shard: sampling sorts and scans the vocabulary, which
    is cheaper after one all-gather of [B, V] than partitioned (on XLA:CPU the partitioned sort ran ~100x slower)."""
    return constrain(logits, rules, ("batch",) + (None,) * (logits.ndim - 1))


def constrain_batch(tree, rules: ShardingRules):
    """Every array of `tree` with its leading (batch) dimension over the batch axes, the rest replicated."""
    if active_mesh() is None:
        return tree
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, rules.spec(("batch",) + (None,) * (a.ndim - 1)))
                        if a.ndim else a, tree)


def check_divisible(shape: Sequence[int], spec: P, mesh: Mesh, what: str) -> None:
    for dim, part in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if part is None:
            continue
        n = axis_size(mesh, (part,) if isinstance(part, str) else part)
        if dim % n:
            raise ConfigError(f"{what}: dimension {dim} cannot be split {n} ways over mesh axes {part}; "
                              f"choose a tensor-parallel degree that divides it")


def param_shardings(cfg, mesh: Mesh):
    """NamedSharding for every weight of `cfg` (the tree of weights.describe), checked for divisibility."""
    from dsjax.weights import describe, is_info

    def one(path, info):
        spec = cfg.sharding.spec(info.axes)
        check_divisible(info.shape, spec, mesh, jax.tree_util.keystr(path))
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, describe(cfg), is_leaf=is_info)


def put(host_array, sharding: NamedSharding):
    """A host array onto its sharding, each device given only its slice; works when the mesh spans several
    processes (each process fills its own devices from its identical host copy)."""
    host_array = np.asarray(host_array)
    return jax.make_array_from_callback(host_array.shape, sharding, lambda index: host_array[index])


