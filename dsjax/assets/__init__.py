"""Checkpoints that ship inside the package: `dsjax.load("dsjax-small")` needs no download.

dsjax-small is the model `dsjax train` trained on one H200 (its README.md says on what data, for how long, at which
held-out loss, and how to reproduce it); the official DeepSeek layout, 15 MB. It is the default of `dsjax generate`,
`dsjax chat` and `dsjax serve`.
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED = {"dsjax-small": os.path.join(_HERE, "dsjax-small")}


def bundled_path(name: str) -> str | None:
    """The directory of a bundled checkpoint, or None when `name` is not one."""
    return BUNDLED.get(name)


def resolve(model: str) -> str:
    """`model` as a path: a bundled checkpoint's directory for its name (unless a path of that name exists)."""
    return bundled_path(model) if not os.path.exists(model) and bundled_path(model) else model
