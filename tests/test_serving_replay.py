"""The slot engine with V4.1's replay prefill schedule (`prefill_schedule="replay"`, `dsjax serve
--prefill-schedule replay`): rows that join at different times, chunk through the encoder layers, and replay
their decoder layers when their prompt ends must give what `Model.generate(prefill_schedule="replay")` gives.

numerics="transformers" (fp32) is batch-invariant, so a row's tokens cannot depend on its slot, its neighbours or
how its prompt was chunked: served greedy tokens and logprobs must equal generate's. tiny-v41 cut to its 5 layers
with every CSA2 role (tests/tiny_v41_cut.py): window 16, the ratio-1 source at layer 3 (encoder layers 0-2, Engram
at 1); prompts of 9, 37 and 70 tokens (shorter than, 2x and 4x the window), the third joining while the others
prefill and decode. The image case needs the ViT: the whole preset.
"""

import numpy as np
import pytest

import dsjax
from dsjax.errors import ConfigError
from dsjax.params import init_params
from dsjax.serving.config import ServeConfig
from dsjax.serving.engine import RowSampling, SlotEngine
from tiny_v41_cut import FIVE_LAYERS

NEW = 4


@pytest.fixture(scope="module")
def model():
    cfg = dsjax.preset("tiny-v41", **FIVE_LAYERS).with_numerics("transformers")
    return dsjax.Model(cfg, init_params(cfg, 5), source="test", max_seq_len=128, max_batch=4)


@pytest.fixture(scope="module")
def vision_model():
    return dsjax.load("tiny-v41", numerics="transformers", max_seq_len=128, max_batch=4, compilation_cache=None)


def _prompts(seed):
    rng = np.random.default_rng(seed)
    return [[0] + rng.integers(3, FIVE_LAYERS["vocab_size"], size=n - 1).tolist() for n in (9, 37, 70)]


def _serve(engine, prompts):
    """Rows 0 and 1 join first; row 2 joins after their first prefill step. Greedy until every row is done."""
    out = {b: ([], []) for b in range(len(prompts))}

    def take(steps):
        for s in steps:
            out[s.slot][0].extend(s.tokens)
            out[s.slot][1].extend(s.logprobs)

    for b in (0, 1):
        engine.join(b, prompts[b], NEW, RowSampling())
    take(engine.prefill_step())
    engine.join(2, prompts[2], NEW, RowSampling())
    while engine.busy():
        take(engine.prefill_step())
        if engine.decoding.any():
            take(engine.decode_step())
    return [out[b] for b in range(len(prompts))]


def _serve_one(engine):
    tokens, logprobs = [], []
    while engine.busy():
        for s in engine.prefill_step() + (engine.decode_step() if engine.decoding.any() else []):
            tokens.extend(s.tokens)
            logprobs.extend(s.logprobs)
    return tokens, logprobs


def test_served_replay_equals_generate_replay(model, test_seed):
    prompts = _prompts(test_seed)
    engine = SlotEngine(model, slots=3, prefill_chunk=16, steps_per_dispatch=2, max_top_logprobs=0,
                        stop_token_ids=(), prefill_schedule="replay", prefix_cache_entries=4)
    served = _serve(engine, prompts)
    # a prompt extending prompt 1 (37 tokens) by 20: the cached row's encoder state is reused; the replay covers
    # positions 41..56 (all new), masking the decoder windows before 41 as a fresh replay does
    longer = prompts[1] + _prompts(test_seed + 1)[1][1:21]
    engine.join(0, longer, NEW, RowSampling())
    assert engine.prompt[0].size == 20
    served.append(_serve_one(engine))
    gens = model.generate(prompts + [longer], NEW, temperature=0.0, stop_token_ids=(), prefill_schedule="replay",
                          steps_per_dispatch=2, logprobs=1)
    for b, ((tokens, logprobs), g) in enumerate(zip(served, gens)):
        assert tokens == g.tokens, f"prompt {b} ({len(prompts[b])} tokens)"
        np.testing.assert_allclose(logprobs, [d["logprob"] for d in g.logprobs], rtol=0, atol=1e-5,
                                   err_msg=f"prompt {b}")


def test_replay_engine_refuses_what_it_cannot_serve(model):
    with pytest.raises(ConfigError, match="ratio-1 KV source"):
        SlotEngine(dsjax.load("tiny-v4", max_seq_len=64, max_batch=1, compilation_cache=None), slots=1,
                   prefill_schedule="replay")
    with pytest.raises(ConfigError, match="choose one of exact, replay"):
        SlotEngine(model, slots=1, prefill_schedule="fast")
    with pytest.raises(ConfigError, match="--prefill-schedule must be exact or replay"):
        ServeConfig(prefill_schedule="fast").validate()
    with pytest.raises(ConfigError, match="without --speculative-config"):
        ServeConfig(prefill_schedule="replay", speculative_config={"method": "mtp"}).validate()


def test_replay_with_an_image(vision_model, test_seed):
    """Images under the replay: the encoder embeds the span, and the decoder layers see its positions again
    (the kept image mask routes them with the VL bias). A prompt with its 8-position span within the 16-token
    window is replayed whole, so it must equal the exact schedule. (The serving engine hands its chunk's image
    to the same `encode_chunk41`.)"""
    model = vision_model
    rng = np.random.default_rng(test_seed)
    image = rng.integers(0, 256, (40, 64, 3), dtype=np.uint8)
    prompt = [0, 128803, model.cfg.image_token_id, 4000, 128804, 128822]      # 5 text + 8 span positions
    kw = dict(temperature=0.0, stop_token_ids=(), logprobs=1, images=[[image]])
    replay = model.generate([prompt], 1, prefill_schedule="replay", **kw)[0]   # 1 token: no decode loop
    exact = model.generate([prompt], 1, **kw)[0]
    assert replay.tokens == exact.tokens
    np.testing.assert_allclose([d["logprob"] for d in replay.logprobs], [d["logprob"] for d in exact.logprobs],
                               rtol=0, atol=1e-6)
