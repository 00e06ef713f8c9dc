"""The training corpus: text available offline whose licence allows training on it, split by file.

Sources: the running interpreter's standard-library sources (`sysconfig`'s stdlib dir, PSF licence; its test
suites included — two thirds of the code, and real code; site-packages left out — third-party licences; files over
256 KB left out — generated tables, not code) and the HTML/JS we wrote ourselves (`dsjax/train/web/`, the project's licence). A file is held out when the crc32 of
its relative path falls in the held-out share, so the split is stable across machines, interpreters' file
orders and runs. Each document is tokenised with the real DeepSeek-V4 tokenizer and framed as BOS text EOS;
documents are concatenated into one token stream per split, from which training windows are cut.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np

WEB_DIR = os.path.join(os.path.dirname(__file__), "web")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class Document:
    name: str   # stable relative name ("stdlib/json/decoder.py", "web/app.js"): the split key
    path: str


def documents(max_files: int | None = None) -> list[Document]:
    """Every corpus file, sorted by name (stdlib .py files, then our web files)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        for f in sorted(files):
            p = os.path.join(d, f)
            if f.endswith(".py") and os.path.getsize(p) <= _MAX_BYTES:
                out.append(Document("stdlib/" + os.path.relpath(p, root).replace(os.sep, "/"), p))
    out.sort(key=lambda doc: doc.name)
    web = [Document("web/" + f, os.path.join(WEB_DIR, f)) for f in sorted(os.listdir(WEB_DIR))
           if f.endswith((".html", ".js"))]
    out = out[:max_files] if max_files else out
    return out + web


def is_held_out(doc: Document, held_out_percent: float) -> bool:
    return zlib.crc32(doc.name.encode()) % 10000 < held_out_percent * 100


def tokenize(docs: list[Document], tokenizer) -> np.ndarray:
    """One int32 stream: BOS doc EOS BOS doc EOS ... (unreadable files are skipped)."""
    texts = []
    for doc in docs:
        try:
            with open(doc.path, encoding="utf-8") as f:
                texts.append(f.read())
        except (OSError, UnicodeDecodeError):
            continue
    bos, eos = tokenizer.special.bos, tokenizer.special.eos
    encoded = tokenizer._hf.encode_batch(texts, add_special_tokens=False)
    parts = [np.asarray([bos] + e.ids + [eos], np.int32) for e in encoded]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def load_splits(tokenizer, *, held_out_percent: float = 5.0, max_files: int | None = None,
                cache: str | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train stream, held-out stream, info); cached as an .npz when `cache` is a path (and read from it when
    it exists: the cache, not this interpreter's stdlib, is then the corpus)."""
    if cache and os.path.exists(cache):
        z = np.load(cache, allow_pickle=False)
        return z["train"], z["held_out"], {"files_train": int(z["files_train"]), "files_held_out": int(z["files_held_out"]),
                                           "python": str(z["python"])}
    docs = documents(max_files)
    train_docs = [d for d in docs if not is_held_out(d, held_out_percent)]
    held_docs = [d for d in docs if is_held_out(d, held_out_percent)]
    if not held_docs:  # a tiny corpus (smoke runs) may draw no held-out file: hold out its first
        held_docs, train_docs = train_docs[:1], train_docs[1:]
    train, held = tokenize(train_docs, tokenizer), tokenize(held_docs, tokenizer)
    info = {"files_train": len(train_docs), "files_held_out": len(held_docs),
            "python": "%d.%d.%d" % sys.version_info[:3]}
    if cache:
        os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
        np.savez_compressed(cache, train=train, held_out=held, **info)
    return train, held, info


def windows(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """`batch` random windows of `seq_len` tokens from the stream: int32 [batch, seq_len]."""
    starts = rng.integers(0, len(stream) - seq_len, size=batch)
    return np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int32)


def eval_windows(stream: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """`n` evenly spaced, non-overlapping (when the stream allows) windows: the fixed held-out set."""
    n = max(1, min(n, len(stream) // seq_len))
    starts = np.linspace(0, len(stream) - seq_len, n).astype(np.int64)
    return np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int32)
