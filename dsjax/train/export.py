"""Export: trained fp32 weights -> the official-layout checkpoint (FP8 linears, FP4 experts) + README.md.

Quantised at export, measured after: every Linear is rounded to its deployment format exactly as a released
checkpoint stores it (FP8 e4m3 with ue8m0 128x128 block scales; routed experts packed FP4 e2m1 with per-32
ue8m0 scales; attn.wo_a to the FP8 grid, since the official layout stores it in FP8 and loaders dequantise it),
everything else cast to its described dtype (bf16 embedding/head/norms/compressors, fp32 hyper-connections).
The held-out loss in the README is then measured on the written directory through `dsjax.load` — the numbers
belong to the checkpoint that ships, not to the fp32 weights it came from (those are reported beside it).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import quant
from dsjax.checkpoint import save_checkpoint
from dsjax.config import ModelConfig
from dsjax.weights import ArrayInfo, Linear, describe, is_info


def quantise(params, cfg: ModelConfig):
    """The weight tree of deployment config `cfg` from (trained) params of its `train_config` twin."""
    tree = describe(cfg)

    def is_node(x):
        return is_info(x) or isinstance(x, Linear)

    def convert(path, node, value):
        if isinstance(node, Linear):
            w = np.asarray(jax.device_get(value.weight), np.float32)
            lead = w.shape[:-2]
            if node.fmt == "fp8":
                q, s = quant.quantize_fp8_blocks(w.reshape((-1,) + w.shape[-2:]), node.block)
                return Linear(jnp.asarray(q.reshape(node.weight.shape)), jnp.asarray(s.reshape(node.scale.shape)),
                              "fp8", node.block)
            if node.fmt == "fp4":
                q, s = quant.quantize_fp4_packed(w.reshape((-1,) + w.shape[-2:]), node.block)
                return Linear(jnp.asarray(q.reshape(lead + q.shape[-2:])), jnp.asarray(s.reshape(lead + s.shape[-2:])),
                              "fp4", node.block)
            return Linear(jnp.asarray(w.astype(jnp.bfloat16)), None, "bf16", 0)
        info: ArrayInfo = node
        a = np.asarray(jax.device_get(value))
        if jax.tree_util.keystr(path).endswith("attn.wo_a") and cfg.weight_dtype == "fp8":
            b = cfg.weight_block_size
            a = quant.dequantize_fp8_blocks_np(*quant.quantize_fp8_blocks(a.astype(np.float32), b), b)
        return jnp.asarray(a.astype(info.dtype))

    return jax.tree_util.tree_map_with_path(convert, tree, params, is_leaf=is_node)


def write(path: str, params, cfg: ModelConfig) -> int:
    """Write the checkpoint; returns model.safetensors' size in bytes."""
    save_checkpoint(params, cfg, path, layout="official", quantize=True)
    return os.path.getsize(os.path.join(path, "model.safetensors"))


def write_readme(path: str, readme: str, info: dict) -> None:
    """README.md (data, steps, loss, command) and train_info.json (the same as JSON) beside the checkpoint."""
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(readme)
    with open(os.path.join(path, "train_info.json"), "w") as f:
        json.dump(info, f, indent=1)


def held_out_loss_loaded(path: str, windows: np.ndarray, *, numerics: str = "reference-bf16", batch: int = 8) -> dict:
    """Held-out next-token CE of the checkpoint at `path`, loaded by `dsjax.load` and scored with
    `Model.logits` (all 129,280 columns)."""
    import dsjax

    model = dsjax.load(path, numerics=numerics, max_seq_len=windows.shape[1], max_batch=batch,
                       compilation_cache=None)
    return {**_score(model.logits, windows, batch), "numerics": numerics}


def held_out_loss_params(params, cfg: ModelConfig, windows: np.ndarray, *, batch: int = 8) -> dict:
    """The same score for in-memory params (the fp32 trained weights under `train_config`): full-vocabulary
    logits, −inf at unmapped ids — so the two figures differ by the export's rounding alone."""
    from dsjax.model import forward

    logits = jax.jit(lambda p, ids: forward(p, cfg, ids))
    return {**_score(lambda ids: logits(params, jnp.asarray(ids)), windows, batch), "numerics": "trained fp32 weights, train_config"}


def _score(logits_fn, windows: np.ndarray, batch: int) -> dict:
    """Mean CE over mapped targets (an unmapped target has a −inf logit: counted apart as `unmapped_share`)."""
    total, count, unmapped = 0.0, 0, 0
    for i in range(0, len(windows) - batch + 1, batch):
        ids = windows[i:i + batch]
        logp = jax.nn.log_softmax(logits_fn(ids), axis=-1)
        tgt = jnp.asarray(ids[:, 1:])
        lp = np.asarray(jnp.take_along_axis(logp[:, :-1], tgt[..., None], axis=-1)[..., 0])
        ok = np.isfinite(lp)
        total += float(-lp[ok].sum())
        count += int(ok.sum())
        unmapped += int((~ok).sum())
    return {"loss": total / max(count, 1), "tokens": count, "unmapped_share": unmapped / max(count + unmapped, 1)}


README = """# {name}: a small trained DeepSeek-V4-architecture checkpoint

Official DeepSeek layout (`config.json` + `model.safetensors`: FP8 e4m3 linears with ue8m0 128x128 block scales,
FP4 e2m1 routed experts with per-32 scales, bf16 embedding/head), loadable with `dsjax.load(path)`.

- Architecture: V4 in miniature — {n_layers} layers (schedule {ratios}: window, CSA ratio 4, HCA ratio 16),
  hash-routed MoE in the first {n_hash} layers, top-{k}-of-{E} MoE after, mHC x{hc}, one MTP layer;
  dim {dim}; {params:,} parameters.
- Vocabulary: the real DeepSeek-V4 tokenizer; the head keeps {rows:,} rows (`head_vocab_size`): the {n_freq:,} most
  frequent ids of the training split plus the chat format's special tokens, and one reserved row for every other
  id. The map is the tensor `vocab_ids`; `Model.logits` returns all 129,280 columns, −inf at unmapped ids.
  Row coverage of held-out tokens: {coverage:.2%}.
- Data: {data}
- Training: {steps:,} steps of {batch}x{seq} tokens ({tokens:,} tokens), AdamW (lr {lr}, warmup {warmup}, cosine to
  {min_lr_ratio}x, weight decay {wd}), loss = next-token CE + {mtp_w} x MTP (token t+2) CE; fp32 master weights, {compute} activations.
- Held-out next-token loss (nats/token over {eval_tokens:,} mapped targets of {eval_windows} windows, scored on
  all 129,280 columns): fp32 trained weights {fp32_main:.4f}; this checkpoint through `dsjax.load` (numerics
  {numerics}) **{loaded:.4f}**. Training objective on the held-out windows at the last step (the reserved row
  a class of its own): next token {obj_main:.4f}, MTP (token t+2) {obj_mtp:.4f}. Lowest held-out next-token
  objective during the run: {best_main:.4f} at step {best_step:,}.
- Run: `{command}` — {train_s:.0f} s of training on {device}. Reproduce exactly: `{reproduce}`

Files: `loss_curve.png` and `history.json` (the run's curves), `train_info.json` (everything above as JSON).
"""
