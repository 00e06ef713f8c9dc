"""`dsjax train`: a small V4-architecture model on an offline corpus, exported in the official layout.

corpus.py (stdlib sources + our HTML/JS, split by file), vocab.py (the reduced vocabulary's map), models.py
(the architectures), loss.py (the differentiable twin config and the joint next-token + MTP loss), loop.py
(optax AdamW, resumable Orbax state, eval, loss curve), export.py (quantise, write, measure through dsjax.load).
"""
