"""V4.1 vision plumbing: decoding with limits and clear errors, the official preprocessor's token budget, the span
layout, the aligner's square order, MoE `bias_vl` on image positions only, Engram's dead n-grams and zero gates,
`Model.generate(images=)` end to end on the tiny model (chunked prefill == a full forward with the same rows),
`dsjax generate --image`, and OpenAI `image_url` parts through the HTTP front end (data URL accepted, remote URL
refused with a 400).

One compiled tiny model serves the end-to-end tests (reference-bf16, max_seq_len 128: the CLI's shapes too)."""

import base64
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import dsjax
from dsjax import cli
from dsjax.errors import ImageError, InputError
from dsjax.layers import engram as E
from dsjax.layers.moe import route
from dsjax.vision import decode_image, expand_placeholders, load_rgb, plan_grid, prepare, span_kinds
from dsjax.vision.aligner import squares
from dsjax.vision.decode import data_url_bytes
from dsjax.vision.layout import END, IMAGE, NEWLINE, START, TEXT
from test_decode import REFERENCE_NOISE
from test_serving_frontend import ScriptedEngine

MAX_SEQ = 128


def encode(rgb: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt, **kw)
    return buf.getvalue()


def smooth_image(rng, h: int, w: int) -> np.ndarray:
    """A gradient with a little noise: JPEG reproduces it closely."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([255 * y / h, 255 * x / w, 128 + 60 * np.sin(x / 7.0)], axis=-1)
    return np.clip(base + rng.normal(0, 2, base.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def model():
    return dsjax.load("tiny-v41", max_seq_len=MAX_SEQ, max_batch=2, compilation_cache=None)


# ---------------------------------------------------------------- decoding
def test_decode_png_exact_and_jpeg_close(test_seed):
    rng = np.random.default_rng(test_seed)
    rgb = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    assert np.array_equal(decode_image(encode(rgb, "PNG")), rgb)  # lossless
    grey = Image.fromarray(rgb).convert("L")
    buf = io.BytesIO()
    grey.save(buf, format="PNG")
    assert np.array_equal(decode_image(buf.getvalue()), np.asarray(grey.convert("RGB")))  # 1 channel -> RGB
    smooth = smooth_image(rng, 48, 64)
    got = decode_image(encode(smooth, "JPEG", quality=95))
    err = np.abs(got.astype(int) - smooth.astype(int)).mean()
    print(f"JPEG q95 mean |error| {err:.2f} levels")
    # q95 JPEG on a smooth image loses about one level on average; 4 leaves room and still catches a wrong channel
    # order or a mis-sized decode, which are off by tens
    assert got.shape == smooth.shape and err < 4.0
    url = "data:image/png;base64," + base64.b64encode(encode(rgb, "PNG")).decode()
    assert np.array_equal(load_rgb(url), rgb)


def test_bad_images_get_clear_errors(test_seed, tmp_path):
    rng = np.random.default_rng(test_seed)
    png = encode(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8), "PNG")
    with pytest.raises(ImageError, match="corrupt"):
        decode_image(png[: len(png) // 2])
    with pytest.raises(ImageError, match="not a recognised image"):
        decode_image(rng.integers(0, 256, 500, dtype=np.uint8).tobytes())
    with pytest.raises(ImageError, match=r"empty \(0 bytes\)"):
        decode_image(b"")
    with pytest.raises(ImageError, match=r"unsupported format PPM; supported formats: PNG, JPEG"):
        decode_image(encode(np.zeros((4, 4, 3), np.uint8), "PPM"))
    with pytest.raises(ImageError, match=r"30x20 = 600 pixels exceeds the limit of 599 pixels"):
        decode_image(png, max_pixels=599)
    with pytest.raises(ImageError, match=r"exceeds the limit of 100 bytes"):
        decode_image(png, max_bytes=100)
    with pytest.raises(ImageError, match=r"zero size \(0x5\)"):
        load_rgb(np.zeros((5, 0, 3), np.uint8))
    with pytest.raises(ImageError, match="not valid base64"):
        data_url_bytes("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="not an image type"):
        data_url_bytes("data:text/plain;base64,aGk=")
    with pytest.raises(ImageError, match="remote URLs are not fetched"):
        load_rgb("https://example.com/cat.png")
    with pytest.raises(ImageError, match="cannot read"):
        load_rgb(str(tmp_path / "missing.png"))


# ---------------------------------------------------------------- preprocessing and layout
def test_token_budget_matches_the_official_preprocessor(test_seed):
    """Span lengths the official image_processor.py (V4.1-Flash, revision dba1be0a) produced for these sizes,
    published with their commands in a third-party fixture review (14x14, 28x14, 56x56, 100x100 -> 184, 202, 184,
    184; 800x600 -> 317); then random sizes keep every invariant the code asserts."""
    cfg = dsjax.preset("v4.1-flash")
    for (w, h), want in {(14, 14): 184, (28, 14): 202, (56, 56): 184, (100, 100): 184, (800, 600): 317}.items():
        assert plan_grid(w, h, cfg).span_length == want, (w, h)
    rng = np.random.default_rng(test_seed)
    for w, h in rng.integers(1, 6000, (200, 2)):
        g = plan_grid(int(w), int(h), cfg)
        assert g.span_length <= 1024 and g.height == 14 * g.vit_rows and g.width == 14 * g.vit_cols
        assert (g.rows, g.cols) == (-(-g.vit_rows // 3), -(-g.vit_cols // 3))
        vh, vw = -(-int(h) // 14), -(-int(w) // 14)
        if w * h >= cfg.vision_min_pixels and -(-vh // 3) * (-(-vw // 3) + 1) + 2 <= 1024:
            assert (g.vit_rows, g.vit_cols) == (vh, vw)  # no upscale, within budget: whole patches covering it
        elif w * h >= cfg.vision_min_pixels:
            assert g.vit_rows <= vh and g.vit_cols <= vw and g.span_length > 1024 // 2  # shrunk, not too far


def test_span_layout():
    kinds = span_kinds(2, 3)
    assert kinds.tolist() == [START, IMAGE, IMAGE, IMAGE, NEWLINE, IMAGE, IMAGE, IMAGE, NEWLINE, END]
    g = plan_grid(100, 60, dsjax.preset("tiny-v41"))
    ids, kinds, starts = expand_placeholders([5, 9, 129264, 7, 129264], [g, g], 129264)
    n = g.span_length
    assert n == g.rows * (g.cols + 1) + 2 and starts == [2, 3 + n]
    assert ids.tolist() == [5, 9] + [129264] * n + [7] + [129264] * n
    assert kinds[:2].tolist() == [TEXT, TEXT] and kinds[2 + n] == TEXT and kinds[2] == START and kinds[-1] == END


def test_aligner_squares_follow_unfold_order(test_seed):
    """Element c·r² + i·r + j of square (y, x) is patch (r·y + i, r·x + j)'s channel c; zeros past the grid."""
    rng = np.random.default_rng(test_seed)
    rows, cols, C, r = 5, 7, 4, 3
    feats = rng.normal(size=(rows * cols, C)).astype(np.float32)
    got = np.asarray(squares(jnp.asarray(feats), rows, cols, r))
    assert got.shape == (2, 3, C * r * r)
    grid = feats.reshape(rows, cols, C)
    for y in range(2):
        for x in range(3):
            for c in range(C):
                for i in range(r):
                    for j in range(r):
                        py, px = r * y + i, r * x + j
                        want = grid[py, px, c] if py < rows and px < cols else 0.0
                        assert got[y, x, c * r * r + i * r + j] == want


# ---------------------------------------------------------------- routing and Engram on image spans
def test_bias_vl_changes_routing_only_on_image_positions(model, test_seed):
    """The tiny model's layer-0 gate on random hidden states: image positions pick top-k of scores + bias_vl, text
    positions of scores + bias; routing weights are the unbiased scores either way. Swapping bias_vl for the text
    bias leaves text positions' experts unchanged and changes some image position's (else the test is vacuous)."""
    cfg, w = model.cfg, model.params.layers[0].ffn
    rng = np.random.default_rng(test_seed)
    x = jnp.asarray(rng.normal(size=(64, cfg.dim)), jnp.bfloat16)
    mask = jnp.asarray(rng.random(64) < 0.5)
    weights, ids = route(x, jnp.zeros(64, jnp.int32), w, cfg, mask)
    scores = jnp.sqrt(jax.nn.softplus(jnp.einsum("nd,ed->ne", x.astype(jnp.float32), w.gate.astype(jnp.float32),
                                                  precision=jax.lax.Precision.HIGHEST)))
    want_text = jax.lax.top_k(scores + w.gate_bias, cfg.n_activated_experts)[1]
    want_image = jax.lax.top_k(scores + w.gate_bias_vl, cfg.n_activated_experts)[1]
    m = np.asarray(mask)
    assert np.array_equal(np.asarray(ids)[~m], np.asarray(want_text)[~m])
    assert np.array_equal(np.asarray(ids)[m], np.asarray(want_image)[m])
    picked = np.take_along_axis(np.asarray(scores), np.asarray(ids), axis=1)
    np.testing.assert_allclose(np.asarray(weights), picked / picked.sum(1, keepdims=True) * cfg.route_scale, rtol=1e-6)
    _, plain = route(x, jnp.zeros(64, jnp.int32), w, cfg)
    assert np.array_equal(np.asarray(plain)[~m], np.asarray(ids)[~m])
    changed = (np.asarray(plain)[m] != np.asarray(ids)[m]).any(axis=1)
    print(f"image positions routed differently by bias_vl: {changed.sum()} of {m.sum()}")
    assert changed.any()


def test_engram_dead_image_tokens(model, test_seed):
    """Row ids with image positions dead (device path == the numpy formula, also across a chunk boundary through
    the history), and the Engram gate: streams at image positions come out bit for bit unchanged."""
    cfg = model.cfg
    rng = np.random.default_rng(test_seed)
    ids = rng.integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    dead = np.zeros((2, 24), bool)
    dead[0, 5:9] = dead[1, 0:3] = dead[1, 20:24] = True
    want = E.hash_ids_reference(cfg, ids, dead)
    hist = E.initial_history(cfg, 2)
    whole = np.asarray(E.hash_ids(cfg, hist, jnp.asarray(ids), jnp.asarray(dead)))
    assert np.array_equal(whole, want)
    first = E.hash_ids(cfg, hist, jnp.asarray(ids[:, :7]), jnp.asarray(dead[:, :7]))
    hist = E.next_history(hist, jnp.asarray(ids[:, :7]), jnp.full((2,), 7, jnp.int32), jnp.asarray(dead[:, :7]))
    second = E.hash_ids(cfg, hist, jnp.asarray(ids[:, 7:]), jnp.asarray(dead[:, 7:]))
    assert np.array_equal(np.concatenate([first, second], axis=1), want)
    assert not np.array_equal(want, E.hash_ids_reference(cfg, ids))  # the dead tokens do change the hashes

    w = model.params.layers[cfg.engram_layer_ids[0]].engram
    h = jnp.asarray(rng.normal(size=(2, 24, cfg.hc_mult, cfg.dim)), jnp.bfloat16)
    rows = E.engram_rows(w.embed, jnp.asarray(whole[:, :, 0]), cfg)
    out = np.asarray(E.engram(h, rows, w, cfg, jnp.asarray(~dead)).astype(jnp.float32))
    hf = np.asarray(h.astype(jnp.float32))
    assert np.array_equal(out[dead], hf[dead])
    assert (np.abs(out[~dead] - hf[~dead]).max(axis=(-1, -2)) > 0).all()


# ---------------------------------------------------------------- end to end
TOP = 8              # top log-probabilities compared between prefill paths
BF16_NOISE = REFERENCE_NOISE["reference-bf16"]  # DeepSeek's own bf16 decode-vs-recompute gap (test_decode)


def assert_top_logprobs_agree(got: dict, got_token: int, want: dict, tol: float):
    """Two first-token top-k lists ({id: logprob}) of prefill paths that should agree within `tol`: at least half
    the tokens are shared and agree within `tol`, and `got`'s greedy token is one `want` ranks within 2 tol of its
    best (a near-tie may flip under rounding; a flip needs the margin to move by both errors)."""
    common = set(got) & set(want)
    assert len(common) >= len(want) // 2, f"top lists share only {sorted(common)}: {got} vs {want}"
    worst = max(abs(got[t] - want[t]) for t in common)
    assert worst <= tol, f"top log-probabilities differ by {worst:.3g} > {tol}: {got} vs {want}"
    assert got_token in want and want[got_token] >= max(want.values()) - 2 * tol, (got_token, want)


def test_generate_with_an_image(model, test_seed):
    """Greedy generation with an image; the same prompt prefilled in chunks of 8 (the span crosses chunk boundaries)
    by `generate` and by the serving engine. The rows at the span are image_start / aligner rows / image_newline /
    image_end, and differ between two images.

    The engine and `generate` run the same chunks: their first-token log-probabilities agree to 1e-5 (a few fp32
    ulps at |logprob| ~ 5-12, from a differently fused log-softmax). Chunks of 8 against one chunk of 16 (a full
    forward) differ by bf16 rounding only: equal bit for bit in fp32 (checked by hand at seed 746886827; test_decode
    checks it for text on every seed), and 0-0.11 apart in bf16 (13 seeds; text prompts alike). The bound is
    DeepSeek's own bf16 decode-vs-recompute gap, 0.34 (tests/test_decode.py), and a near-tie may flip the greedy
    token (seed 746886827: margin 0.0016), so the tokens are compared by their log-probabilities, not by identity.
    A different image moves these log-probabilities by 0.3-0.5 and replaces most of the top 8."""
    from dsjax.serving.engine import RowSampling, SlotEngine
    from dsjax.vision.inputs import prepare_prompt

    rng = np.random.default_rng(test_seed)
    png = encode(smooth_image(rng, 40, 64), "PNG")
    cfg = model.cfg
    prompt = [0, 128803, cfg.image_token_id, 4000, 5000, 128804, 128822]
    gens = model.generate([prompt], 4, images=[[png]], logprobs=TOP)
    assert len(gens[0].tokens) == 4
    expanded, rows = prepare(model.params, cfg, [prompt], [[png]])
    ids = expanded[0]
    idx = rows.index[0]
    span = np.flatnonzero(idx >= 0)
    assert span[0] == 2 and len(span) == plan_grid(64, 40, cfg).span_length and (ids[span] == cfg.image_token_id).all()
    r = np.asarray(rows.rows.astype(jnp.float32))
    p = model.params
    assert np.array_equal(r[idx[span[0]]], np.asarray(p.image_start, np.float32))
    assert np.array_equal(r[idx[span[-1]]], np.asarray(p.image_end, np.float32))
    newline = span[rows.kinds[0][span] == NEWLINE]
    assert len(newline) and all(np.array_equal(r[idx[i]], np.asarray(p.image_newline, np.float32)) for i in newline)
    other = prepare(p, cfg, [prompt], [[encode(smooth_image(rng, 40, 64)[::-1], "PNG")]])[1]
    assert not np.array_equal(np.asarray(other.rows.astype(jnp.float32)), r)

    chunked = model.generate([prompt], 4, images=[[png]], logprobs=TOP, prefill_chunk=8)
    engine = SlotEngine(model, slots=1, prefill_chunk=8, steps_per_dispatch=2, max_top_logprobs=TOP)
    engine.join(0, ids.tolist(), 4, RowSampling(), top_logprobs=TOP, images=prepare_prompt(cfg, prompt, [png]))
    out = []
    while not out:
        out = engine.prefill_step()
    full, by_chunks = (dict(g[0].logprobs[0]["top"]) for g in (gens, chunked))
    served = dict(out[0].top[0])
    print(f"first token: full {gens[0].tokens[0]}, chunks of 8 {chunked[0].tokens[0]}, engine {out[0].tokens[0]}; "
          f"full top {sorted(full.items(), key=lambda kv: -kv[1])[:2]}")
    assert_top_logprobs_agree(served, out[0].tokens[0], by_chunks, 1e-5)
    assert_top_logprobs_agree(by_chunks, chunked[0].tokens[0], full, BF16_NOISE)
    assert engine.cache.lookup(ids)[0] == 0  # a prompt with images never enters the prefix cache
    with pytest.raises(InputError, match=r"prompt 0 holds 1 image placeholder\(s\) .* but 2 image\(s\)"):
        model.generate([prompt], 2, images=[[png, png]])


def test_cli_generate_image(model, tmp_path, capsys, test_seed):
    rng = np.random.default_rng(test_seed)
    path = tmp_path / "picture.jpg"
    path.write_bytes(encode(smooth_image(rng, 40, 64), "JPEG", quality=90))
    args = ["generate", "--model", "tiny-v41", "--prompt", "What is this?", "--image", str(path), "--json",
            "--max-new-tokens", "4", "--max-seq-len", str(MAX_SEQ)]
    assert cli.main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prompt_ids"].count(model.cfg.image_token_id) == 1 and len(res["token_ids"]) == 4
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    assert cli.main(args[:6] + [str(bad)] + args[7:]) == 2
    assert "broken.png: not a recognised image" in capsys.readouterr().err


# ---------------------------------------------------------------- OpenAI image_url
class RecordingEngine(ScriptedEngine):
    """The front-end tests' engine (SlotEngine's interface), recording what joins and answering EOS at once."""

    def __init__(self):
        super().__init__(slots=2)
        self.joined = []

    def join(self, slot, prompt, max_new, sampling, top_logprobs=0, start=None, images=None):
        self.joined.append((list(prompt), images))
        self.rows[slot] = True
        return 0

    def decode_step(self):
        from dsjax.serving.engine import StepOutput
        out = [StepOutput(b, [1], [-0.1], [[]], "stop") for b in self.rows]
        self.rows.clear()
        return out


def test_openai_image_url_parts(test_seed):
    import openai

    from dsjax.serving.config import ServeConfig
    from dsjax.serving.openai_protocol import ApiError, Limits, parse_chat
    from dsjax.serving.scheduler import Scheduler
    from dsjax.serving.server import ServerThread
    from dsjax.serving.service import ModelInfo, Service
    from dsjax.tokenizer import load_tokenizer

    rng = np.random.default_rng(test_seed)
    rgb = smooth_image(rng, 30, 50)
    url = "data:image/png;base64," + base64.b64encode(encode(rgb, "PNG")).decode()
    parts = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}}]
    p = parse_chat({"model": "m", "messages": [{"role": "user", "content": parts}]}, Limits(max_model_len=512))
    assert len(p.images) == 1 and np.array_equal(p.images[0], rgb)
    with pytest.raises(ApiError, match="remote image URLs are not fetched") as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, Limits(max_model_len=512))
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].image_url"

    cfg = dsjax.preset("tiny-v41")
    engine = RecordingEngine()
    tok = load_tokenizer("v4.1")
    info = ModelInfo(id="m", source="scripted", family="v4.1", max_model_len=512, max_num_seqs=2,
                     vocab_size=cfg.vocab_size, eos_token_id=1)
    svc = Service(info, tok, Scheduler(engine, max_queue=2), Limits(max_model_len=512), vision_cfg=cfg)
    st = ServerThread(ServeConfig(model="m", port=0, grpc_port=-1, drain_timeout=5), svc).start(timeout=60)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="x", max_retries=0,
                               timeout=20)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": parts}], max_tokens=4)
        assert r.choices[0].finish_reason == "stop"
        prompt, images = engine.joined[-1]
        n = plan_grid(50, 30, cfg).span_length
        assert prompt.count(cfg.image_token_id) == n and images is not None and images.ids.tolist() == prompt
        assert r.usage.prompt_tokens == len(prompt)
        for content, match in (([{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}],
                                "remote image URLs are not fetched by this server"),
                               ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                                "not a recognised image")):
            with pytest.raises(openai.BadRequestError, match=match) as e:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}])
            assert e.value.status_code == 400
    finally:
        st.stop()
