"""dsjax train: the reduced vocabulary's map and logits, the full-vocabulary path untouched, the optimizer step
lowering the loss, Orbax resume, and export -> dsjax.load -> the same logits. One tiny config (every V4 layer
kind: window, CSA, HCA; hash and top-k MoE; MTP) shared by every test, so the train step compiles once."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.model import head_logits, head_rows, token_rows
from dsjax.params import init_params
from dsjax.train import corpus, export, loop, vocab
from dsjax.train.loss import split, train_config, with_vocab
from dsjax.train.models import model_config
from dsjax.weights import describe

V = 129280
SEQ, BATCH = 32, 2


def tiny_cfg(rows: int):
    """CSA + hash-routed MoE, HCA + top-k MoE, and the window-only MTP layer: every kind in two layers."""
    return model_config("smoke", rows).replace(n_layers=2, compress_ratios=(4, 16, 0), n_hash_layers=1)


@pytest.fixture(scope="module")
def setup(test_seed):
    """(deploy cfg, train cfg, params with a random vocabulary map, a fixed token stream over mapped and unmapped ids)."""
    rng = np.random.default_rng(test_seed)
    freq_ids = rng.choice(V, size=120, replace=False)
    stream = rng.choice(freq_ids, size=4000).astype(np.int32)
    stream[rng.random(4000) < 0.05] = rng.integers(0, V, size=int((rng.random(4000) < 0.05).sum()) or 1)[0]
    vocab_ids = vocab.build(stream, 100, [0, 1, 128803, 128804])
    cfg = tiny_cfg(len(vocab_ids))
    tcfg = train_config(cfg)
    params = with_vocab(init_params(tcfg, test_seed % 1000), vocab_ids)
    return cfg, tcfg, params, stream, vocab_ids


def test_vocab_map_round_trips(setup, test_seed):
    _, tcfg, params, stream, vocab_ids = setup
    rows = len(vocab_ids)
    assert vocab_ids[-1] == V and np.all(np.diff(vocab_ids[:-1]) > 0)
    mapped = vocab_ids[:-1]
    assert np.array_equal(vocab.ids_of(vocab_ids, vocab.rows_of(vocab_ids, mapped)), mapped)
    assert np.array_equal(vocab.rows_of(vocab_ids, vocab.ids_of(vocab_ids, np.arange(rows - 1))), np.arange(rows - 1))
    unmapped = np.setdiff1d(np.arange(V), mapped)
    assert np.all(vocab.rows_of(vocab_ids, unmapped) == rows - 1)
    every = np.arange(V, dtype=np.int32)  # the model's own map agrees with the numpy one on every id
    assert np.array_equal(np.asarray(token_rows(params, tcfg, jnp.asarray(every))), vocab.rows_of(vocab_ids, every))
    assert {0, 1, 128803, 128804} <= set(mapped.tolist())


def test_corpus_split_is_by_file_and_stable():
    docs = corpus.documents()
    names = [d.name for d in docs]
    assert len(names) == len(set(names)) and {"web/page.html", "web/app.js"} <= set(names)
    assert all(n.startswith("stdlib/") and "site-packages" not in n for n in names[:-2])
    held = {d.name for d in docs if corpus.is_held_out(d, 5.0)}
    assert held == {d.name for d in corpus.documents() if corpus.is_held_out(d, 5.0)}  # same split every time
    assert 0.01 < len(held) / len(names) < 0.12


def test_full_vocabulary_path_unchanged():
    """No map configured: no vocab_ids leaf, full-size tables, ids used as rows, head_logits == head_rows."""
    cfg = tiny_cfg(0)
    tree = describe(cfg)
    assert tree.vocab_ids is None and tree.embed.shape == (V, cfg.dim) and tree.head.shape == (V, cfg.dim)
    assert tree.layers[0].ffn.tid2eid.shape[0] == V
    ids = jnp.arange(8, dtype=jnp.int32)[None]
    assert token_rows(None, cfg, ids) is ids
    small = dataclasses.replace(cfg, vocab_size=512, n_layers=1, compress_ratios=(0, 0), n_hash_layers=0)
    h = jax.random.normal(jax.random.key(0), (1, 2, cfg.hc_mult, cfg.dim))
    p = init_params(small, 0)  # the same code path as 129,280 columns, a cheaper table
    assert np.array_equal(np.asarray(head_logits(h, p, small, p.hc_head, p.norm)),
                          np.asarray(head_rows(h, p, small, p.hc_head, p.norm)))


def settings(**kw):
    return loop.TrainSettings(**{**dict(steps=6, batch_size=BATCH, seq_len=SEQ, lr=3e-3, warmup_steps=1,
                                        eval_every=0, ckpt_every=2, seed=7), **kw})


def test_steps_reduce_loss_on_a_fixed_batch(setup):
    _, tcfg, params, stream, _ = setup
    s = settings()
    step = loop.make_step(tcfg, s)
    train, frozen, opt_state = loop.initial_state(params, s)
    batch = jnp.asarray(loop.batch_at(stream, s, 0))
    losses = []
    for i in range(6):
        train, opt_state, m = step(train, opt_state, frozen, batch, jnp.float32(loop.learning_rate(i, s, s.steps)))
        losses.append(float(m["loss"]))
    print("losses on one batch:", losses)
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0]


def test_learning_rate_is_optax_warmup_cosine():
    import optax

    s = loop.TrainSettings(steps=1000, lr=3e-3, warmup_steps=50, min_lr_ratio=0.1)
    ref = optax.warmup_cosine_decay_schedule(0.0, s.lr, s.warmup_steps, s.steps, s.lr * s.min_lr_ratio)
    for step in (0, 1, 25, 49, 50, 51, 400, 999, 1000, 1200):
        np.testing.assert_allclose(loop.learning_rate(step, s, s.steps), float(ref(step)), rtol=1e-5, atol=1e-9)


def test_a_fixed_schedule_is_kept_on_resume(setup, tmp_path):
    """A time-budgeted run's total steps (OUT/schedule.json) outlives the process that fixed it."""
    _, tcfg, params, stream, _ = setup
    (tmp_path / "schedule.json").write_text('{"steps": 17}')
    _, _, hist = loop.train(tcfg, params, stream, stream, settings(), str(tmp_path), until=1, progress=False)
    assert hist["steps"] == 17 and hist["train"][-1]["lr"] == pytest.approx(loop.learning_rate(0, settings(), 17))


def test_resume_continues_with_identical_state(setup, tmp_path):
    _, tcfg, params, stream, _ = setup
    kw = dict(progress=False, log_every=1)
    straight, _, _ = loop.train(tcfg, params, stream, stream, settings(), str(tmp_path / "a"), until=3, **kw)
    loop.train(tcfg, params, stream, stream, settings(), str(tmp_path / "b"), until=2, **kw)
    mgr = loop.checkpoint_manager(str(tmp_path / "b" / "checkpoints"), settings())
    step, saved, _ = loop.restore_state(mgr, split(params)[0], loop.optimizer(settings()).init(split(params)[0]))
    mgr.close()
    assert step == 2
    resumed, _, hist = loop.train(tcfg, params, stream, stream, settings(), str(tmp_path / "b"), until=3, **kw)
    assert [r["step"] for r in hist["train"]] == [1, 2, 3]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_export_load_gives_the_quantised_logits(setup, tmp_path):
    """export.quantise -> official layout -> dsjax.load: every weight comes back bit for bit, so Model.logits
    equals the in-memory quantised model's logits exactly (tolerance 0: same bits through the same program)."""
    import dsjax
    from dsjax.api import _logits

    cfg, tcfg, params, stream, vocab_ids = setup
    q = export.quantise(params, cfg)
    export.write(str(tmp_path), q, cfg)
    model = dsjax.load(str(tmp_path), max_seq_len=SEQ, max_batch=BATCH, compilation_cache=None)
    assert model.cfg.head_vocab_size == len(vocab_ids)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(model.params)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    ids = corpus.eval_windows(stream, BATCH, SEQ)
    got = np.asarray(model.logits(ids))
    want = np.asarray(_logits(q, jnp.asarray(ids), cfg=model.cfg, positions=None, max_seq=model.max_seq_len))
    assert got.shape == (BATCH, SEQ, V) and np.array_equal(got, want)
    unmapped = np.ones(V, bool)
    unmapped[vocab_ids[:-1]] = False
    assert np.all(got[..., unmapped] == -np.inf) and np.all(np.isfinite(got[..., ~unmapped]))


def test_cli_train_parses_with_h200_defaults_and_smoke():
    from dsjax.cli import build_parser

    args = build_parser().parse_args(["train"])
    assert (args.model, args.steps, args.batch_size, args.seq_len, args.compute_dtype) == \
        ("small", 6000, 32, 512, "bfloat16")
    assert build_parser().parse_args(["train", "--smoke", "--out", "x"]).smoke
