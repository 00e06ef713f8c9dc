"""The reduced vocabulary: which token ids get a row of the embedding and the head.

A trained model of a few million parameters cannot afford 129,280 rows of embedding and head (2 x 129,280 x D),
and a code corpus uses a small share of them. So the model keeps `head_vocab_size` rows (config field): the N
most frequent ids of the *training* split (ties broken by the smaller id), every special token the chat format
needs (BOS, EOS/pad, User, Assistant, think start/end, DSML, latest reminder), and one reserved row last. The
mapping is the weight tensor `vocab_ids` int32 [rows], stored in the checkpoint beside the others: row r stands
for token id vocab_ids[r]; the reserved row holds id `vocab_size` (no column). Unmapped input ids read the
reserved row; `Model.logits` scatters the rows into all vocab_size columns and leaves −inf at unmapped ids
(dsjax.model.token_rows / scatter_vocab). Ids are sorted, so the mapping round-trips exactly both ways.
"""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 129280


def chat_special_ids(tokenizer) -> list[int]:
    s = tokenizer.special
    ids = [s.bos, s.eos, s.pad, s.user, s.assistant, s.system, s.think_start, s.think_end, s.dsml, s.latest_reminder]
    return sorted({i for i in ids if i is not None})


def build(train_tokens: np.ndarray, n_frequent: int, special_ids, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """vocab_ids int32 [rows]: sorted mapped ids (the n most frequent ∪ specials), then the reserved id."""
    counts = np.bincount(np.asarray(train_tokens, np.int64), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, smaller id on ties
    frequent = order[:n_frequent][counts[order[:n_frequent]] > 0]
    mapped = np.union1d(frequent, np.asarray(list(special_ids), np.int64))
    return np.append(mapped, vocab_size).astype(np.int32)


def rows_of(vocab_ids: np.ndarray, token_ids, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """Token ids -> rows (unmapped ids -> the reserved last row); the numpy twin of dsjax.model.token_rows."""
    table = np.full(vocab_size, len(vocab_ids) - 1, np.int32)
    mapped = vocab_ids[vocab_ids < vocab_size]
    table[mapped] = np.arange(len(mapped), dtype=np.int32)
    return table[np.asarray(token_ids)]


def ids_of(vocab_ids: np.ndarray, rows) -> np.ndarray:
    """Rows -> token ids (the reserved row gives vocab_size, an id with no column)."""
    return vocab_ids[np.asarray(rows)]


def coverage(vocab_ids: np.ndarray, tokens: np.ndarray, vocab_size: int = VOCAB_SIZE) -> float:
    """Share of `tokens` that have their own row."""
    return float(np.mean(rows_of(vocab_ids, tokens, vocab_size) < len(vocab_ids) - 1)) if len(tokens) else 1.0
