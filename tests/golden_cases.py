"""Discovery of the official-reference golden cases under tests/data/goldens (one folder per case)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "data", "goldens")


@dataclasses.dataclass(frozen=True)
class GoldenCase:
    name: str
    family: str          # "v4" | "v4.1"
    path: str
    manifest: dict

    def inputs(self) -> dict[str, np.ndarray]:
        with np.load(os.path.join(self.path, "inputs.npz")) as z:
            return {k: z[k] for k in z.files}

    def golden(self, variant: str) -> dict[str, np.ndarray]:
        with np.load(os.path.join(self.path, f"golden_{variant}.npz")) as z:
            return {k: z[k] for k in z.files}

    def noise(self, variant: str) -> dict:
        return self.manifest["variants"][variant]


def discover(family: str | None = None) -> list[GoldenCase]:
    cases = []
    if not os.path.isdir(GOLDEN_DIR):
        return cases
    for name in sorted(os.listdir(GOLDEN_DIR)):
        mpath = os.path.join(GOLDEN_DIR, name, "manifest.json")
        if not os.path.exists(mpath):
            continue
        with open(mpath) as f:
            manifest = json.load(f)
        fam = "v4.1" if "4.1" in manifest.get("family", "") else "v4"
        if family is None or fam == family:
            cases.append(GoldenCase(name, fam, os.path.join(GOLDEN_DIR, name), manifest))
    return cases


def bf16_ulps(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|ours − ref| in units of the bf16 ulp at the reference value (ulp of 0 taken at the smallest normal)."""
    ref = ref.astype(np.float32)
    mag = np.maximum(np.abs(ref), np.float32(2.0 ** -126))
    ulp = np.exp2(np.floor(np.log2(mag)) - 7)
    return np.abs(ours.astype(np.float32) - ref) / ulp
