"""Loading straight into shardings: each device's slice is read from the file, never the whole tree on the host.

The load runs in a fresh process (this file run as a script) with 8 CPU devices — this process already started
JAX with one. On CPU the devices' arrays live in host memory too, so the measure is the process's peak resident
memory during the load minus what it started from minus the bytes of every shard of every live array: what the
loader itself held on the way. That must stay under 2 x the largest leaf + 64 MB (one leaf's host slices while
they are copied to the devices, plus slack), while the checkpoint is ~120 MB: loading whole and then
re-sharding, or keeping the file's mapped pages resident, would exceed it by the model's size.

The config is tiny-v4 widened so that every sharded dimension divides by 8 (heads, wo_a groups, indexer heads,
the shared expert's 1024 rows = 8 FP8 blocks, 64 routed experts) and big enough to measure: 64 FP4 experts of
1024 x 256 per layer make ~26 MB a layer, and each stacked expert leaf (8 MB) is the largest tensor.
"""

import gc
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

CFG = dict(vocab_size=8192, dim=256, n_layers=3, compress_ratios=(0, 4, 16, 0), n_hash_layers=1, n_heads=8,
           o_groups=8, o_lora_rank=128, moe_inter_dim=1024, index_n_heads=16, n_routed_experts=64)
SEQ = 40  # > index_topk CSA entries and two complete HCA groups
# transformers' layout, sharded 4 ways (its 4 heads allow no more): the renamed view, with fused experts
SMALL = dict(vocab_size=1024, n_layers=3, compress_ratios=(0, 4, 16, 0), n_hash_layers=1)


def _write_fused_transformers(path: str, seed: int) -> str:
    """transformers' saved layout at `path`, and a copy whose routed experts are fused per layer as
    model.state_dict() holds them (gate_up_proj [E, 2I, D], down_proj [E, D, I]), read through slicing views."""
    from dsjax import checkpoint, safetensors_io
    from dsjax.config import _tiny_v4
    from dsjax.params import init_params

    cfg = _tiny_v4(**SMALL)
    checkpoint.save_checkpoint(init_params(cfg, seed, put=np.asarray), cfg, path, layout="transformers")
    fused = path + "-fused"
    os.makedirs(fused)
    shutil.copy(os.path.join(path, "config.json"), fused)
    f = safetensors_io.SafetensorsFile(os.path.join(path, "model.safetensors"))
    t = {n: np.array(f.get(n)) for n in f.names()}
    for L in range(cfg.n_layers):
        w = [{k: t.pop(f"model.layers.{L}.ffn.experts.{e}.{k}.weight") for k in ("w1", "w2", "w3")}
             for e in range(cfg.n_routed_experts)]
        t[f"model.layers.{L}.mlp.experts.gate_up_proj"] = np.stack([np.concatenate([x["w1"], x["w3"]]) for x in w])
        t[f"model.layers.{L}.mlp.experts.down_proj"] = np.stack([x["w2"] for x in w])
    safetensors_io.write(os.path.join(fused, "model.safetensors"), t)
    return fused


def test_sharded_load_streams_into_the_mesh(tmp_path, test_seed):
    from dsjax import checkpoint
    from dsjax.config import _tiny_v4
    from dsjax.params import init_params

    cfg = _tiny_v4(**CFG)
    path = str(tmp_path / "tiny-v4")
    t0 = time.time()
    params = init_params(cfg, test_seed, put=np.asarray)
    checkpoint.save_checkpoint(params, cfg, path)
    del params
    gc.collect()
    hf = _write_fused_transformers(str(tmp_path / "tiny-v4-hf"), test_seed)
    assert_same(checkpoint.load_params(hf), checkpoint.load_params(str(tmp_path / "tiny-v4-hf")))
    t1 = time.time()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), path, hf, str(test_seed)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mb = {k: round(v / 2**20, 1) for k, v in m.items() if k.endswith("bytes")}
    print(f"\ncheckpoint written in {t1 - t0:.1f} s, checked in a subprocess in {time.time() - t1:.1f} s; MB: {mb}; "
          f"peak RSS reset: {m['reset']}; max |logits diff| sharded vs one device: {m['logits_diff']:.2e}")
    bound = 2 * m["largest_bytes"] + (64 << 20)
    assert m["held_bytes"] < bound, f"the loader held {mb['held_bytes']} MB on the host; bound {bound >> 20} MB"


# ---------------------------------------------------------------------- the subprocess
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _live_bytes() -> int:
    import jax

    return sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards)


def assert_same(got, want) -> None:
    """Same tree, and every leaf has the same dtype, shape and bytes."""
    import jax

    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), jax.tree_util.keystr(p)


def _check_sharded(params, shardings, single) -> None:
    """Every leaf has its requested sharding and the bytes of the one-device load."""
    import jax

    for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
        assert a.sharding == s, (a.sharding, s)
    assert_same(params, single)


def _main(path: str, hf: str, seed: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    import dsjax
    from dsjax import checkpoint, sharding
    from dsjax.weights import describe, is_info

    cfg = checkpoint.checkpoint_config(path)
    mesh = sharding.make_mesh(tp=8)
    shardings = sharding.param_shardings(cfg, mesh)
    largest = max(int(np.prod(i.shape)) * np.dtype(i.dtype).itemsize
                  for i in jax.tree.leaves(describe(cfg), is_leaf=is_info))
    jax.device_put(np.zeros(8), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())).block_until_ready()
    gc.collect()
    try:  # reset the peak to the current resident size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    base, live0 = _status("VmRSS"), _live_bytes()

    params = checkpoint.load_params(path, cfg, shardings=shardings)
    jax.block_until_ready(params)
    peak, live = _status("VmHWM"), _live_bytes() - live0

    _check_sharded(params, shardings, checkpoint.load_params(path, cfg))
    del params

    hf_cfg = checkpoint.checkpoint_config(hf)
    hf_shardings = sharding.param_shardings(hf_cfg, sharding.make_mesh(tp=4))
    _check_sharded(checkpoint.load_params(hf, hf_cfg, shardings=hf_shardings), hf_shardings,
                   checkpoint.load_params(hf, hf_cfg))

    ids = np.random.default_rng([seed, 1]).integers(0, cfg.vocab_size, size=(2, SEQ), dtype=np.int32)
    logits = {}
    for key, kw in [("mesh", dict(mesh=sharding.make_mesh(tp=8))), ("one", {})]:
        model = dsjax.load(path, numerics="transformers", compilation_cache=None, **kw)
        logits[key] = np.asarray(model.logits(ids))
        del model
    assert np.isfinite(logits["mesh"]).all() and logits["one"].std() > 0.1
    diff = float(np.abs(logits["mesh"] - logits["one"]).max())
    assert diff <= 1e-4, diff
    print(json.dumps(dict(peak_bytes=peak - base, live_bytes=live, held_bytes=peak - base - live,
                          largest_bytes=largest, file_bytes=os.path.getsize(os.path.join(path, "model.safetensors")),
                          reset=reset, logits_diff=diff)))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
