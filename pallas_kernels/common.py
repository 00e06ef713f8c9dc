"""Helpers every kernel shares: stored-row formats and their dequantisation, padding, backend selection.

The dequantisers use only elementwise ops, slices along the last dim and bitcasts, so the same code runs in
the XLA paths and inside Pallas kernels on loaded tiles. They decode the layouts of `dsjax.kv_rows`:

- main KV row (V4): `nope` e4m3 codes | nope/block ue8m0 scale bytes | rope dims as little-endian bf16 | pad;
- index-key row: e2m1 codes two per byte (low nibble first) | one ue8m0 byte per `block` values.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("reference", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class MainRowFormat:
    """Layout of a compact main-KV row (584 bytes for V4: 448 codes + 7 scales + 128 rope bytes + 1 pad)."""
    nope: int = 448
    rope: int = 64
    block: int = 64

    @property
    def dim(self) -> int:
        return self.nope + self.rope

    @property
    def row_bytes(self) -> int:
        raw = self.nope + self.nope // self.block + 2 * self.rope
        return -(-raw // 8) * 8

    @classmethod
    def from_config(cls, cfg) -> "MainRowFormat":
        return cls(nope=cfg.nope_head_dim, rope=cfg.rope_head_dim, block=cfg.kv_quant_block)


@dataclasses.dataclass(frozen=True)
class Fp4RowFormat:
    """Layout of a V4.1 compressed main-KV row (288 bytes for 512 dims, spec §4.1): e2m1 codes two per byte (low
    nibble first) | one e4m3 scale byte per `block` values (`dsjax.v41_rows.quantize_main`)."""
    dim: int = 512
    block: int = 16

    @property
    def row_bytes(self) -> int:
        return self.dim // 2 + self.dim // self.block

    @classmethod
    def from_config(cls, cfg) -> "Fp4RowFormat":
        return cls(dim=cfg.head_dim)


@dataclasses.dataclass(frozen=True)
class IndexRowFormat:
    """Layout of a compact index-key row (68 bytes for 128 dims: 64 packed bytes + 4 scales)."""
    dim: int = 128
    block: int = 32

    @property
    def row_bytes(self) -> int:
        return self.dim // 2 + self.dim // self.block

    @classmethod
    def from_config(cls, cfg) -> "IndexRowFormat":
        return cls(dim=cfg.index_head_dim, block=cfg.index_quant_block)


def check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation


def pick_backend(kernel_options: dict, modules: dict):
    """Pops kernel_options["backend"] (default "triton") and returns its module; a clear error for unknown names."""
    backend = kernel_options.pop("backend", "triton")
    if backend not in modules:
        raise ValueError(f"backend must be one of {tuple(modules)}, got {backend!r}")
    return modules[backend]


def e8m0_to_f32(u8):
    """ue8m0 byte e -> 2^(e-127) in fp32 (byte 0 -> the subnormal 2^-127, as dsjax.quant decodes it)."""
    u = u8.astype(jnp.uint32)
    bits = jnp.where(u == 0, np.uint32(0x00400000), u << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequant_main_rows(rows, fmt: MainRowFormat):
    """uint8 [..., row_bytes] -> fp32 [..., dim]; exact (the values are already fake-quantised)."""
    lead = rows.shape[:-1]
    nb = fmt.nope // fmt.block
    codes = jax.lax.bitcast_convert_type(rows[..., :fmt.nope], jnp.float8_e4m3fn).astype(jnp.float32)
    scales = e8m0_to_f32(rows[..., fmt.nope:fmt.nope + nb])
    nope = (codes.reshape(lead + (nb, fmt.block)) * scales[..., None]).reshape(lead + (fmt.nope,))
    rb = rows[..., fmt.nope + nb: fmt.nope + nb + 2 * fmt.rope].astype(jnp.uint16).reshape(lead + (fmt.rope, 2))
    rope = jax.lax.bitcast_convert_type(rb[..., 0] | (rb[..., 1] << 8), jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([nope, rope], axis=-1)


def fp4_code_to_f32(c):
    """e2m1 code (sign in bit 3) -> fp32 built from its bits, integer ops only (no table gather, no float selects:
    cheap in a kernel): e == 0 -> 0.5·m, else (1 + m/2)·2^(e-1), signed zeros kept."""
    c = c.astype(jnp.int32)
    m, e = c & 1, (c >> 1) & 3
    bits = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22)) | ((c >> 3) << 31)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def dequant_index_rows(rows, fmt: IndexRowFormat):
    """uint8 [..., row_bytes] -> fp32 [..., dim]; exact."""
    lead = rows.shape[:-1]
    half, nb = fmt.dim // 2, fmt.dim // fmt.block
    packed = rows[..., :half]
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(lead + (fmt.dim,))
    scales = e8m0_to_f32(rows[..., half:half + nb])
    vals = fp4_code_to_f32(codes).reshape(lead + (nb, fmt.block)) * scales[..., None]
    return vals.reshape(lead + (fmt.dim,))


def dequant_fp4_main_rows(rows, fmt: Fp4RowFormat):
    """uint8 [..., dim/2 + dim/block] -> fp32 [..., dim]; exact (e2m1 codes x e4m3 block scales)."""
    lead = rows.shape[:-1]
    half, nb = fmt.dim // 2, fmt.dim // fmt.block
    packed = rows[..., :half]
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(lead + (fmt.dim,))
    scales = jax.lax.bitcast_convert_type(rows[..., half:half + nb], jnp.float8_e4m3fn).astype(jnp.float32)
    vals = fp4_code_to_f32(codes).reshape(lead + (nb, fmt.block)) * scales[..., None]
    return vals.reshape(lead + (fmt.dim,))


def load_rows(stored, fmt):
    """Stored rows -> fp32 values: uint8 rows are dequantised with `fmt`, anything else is already values."""
    if stored.dtype == jnp.uint8:
        decode = {MainRowFormat: dequant_main_rows, Fp4RowFormat: dequant_fp4_main_rows}.get(type(fmt),
                                                                                              dequant_index_rows)
        return decode(stored, fmt)
    return stored.astype(jnp.float32)


def row_width(stored, fmt) -> int:
    """The value dim of stored rows."""
    return fmt.dim if stored.dtype == jnp.uint8 else stored.shape[-1]


def pad_axis(x, axis: int, multiple: int, value):
    """Pad `axis` of x up to a multiple of `multiple` with `value` (tiles never read past the end)."""
    n = x.shape[axis]
    extra = -n % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def round_bf(x, dtype):
    """Round an fp32 array to `dtype` and back: the reference's intermediate roundings, kernel-safe.

    bf16 rounds to nearest even on the fp32 bits with integer ops: XLA may drop an f32 -> bf16 -> f32 round trip
    (excess precision, as in interpret mode), Triton has no `reduce_precision`, integer ops survive both."""
    x = x.astype(jnp.float32)
    if jnp.dtype(dtype) == jnp.float32:
        return x
    if jnp.dtype(dtype) != jnp.bfloat16:
        return x.astype(dtype).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def gpu_interpret(interpret):
    """`interpret` for plgpu.kernel: None on a GPU (compile), Mosaic GPU interpret mode elsewhere (tests)."""
    if interpret is not None:
        return interpret
    if jax.default_backend() == "gpu":
        return None
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams()


# ----------------------------------------------------------------------------- stored weight tiles (moe_gemm)
# Dequantisation of tiles of `dsjax.weights.Linear` weights, stack-free (jnp.stack does not lower in Mosaic GPU):
# the same code serves the XLA paths on whole stacked weights and the kernels on loaded tiles. Exact in fp32
# (ue8m0 scales are powers of two, e4m3/e2m1 values need few bits), as `dsjax.quant`'s codecs give them.


def _repeat_last(a, r: int):
    """[..., n] -> [..., n*r], each entry r times (broadcast + reshape, no gather, no stack)."""
    return jnp.broadcast_to(a[..., None], a.shape + (r,)).reshape(a.shape[:-1] + (a.shape[-1] * r,))


def dequant_fp8_weight(codes, scale_u8, block: int):
    """e4m3 (or its uint8 bytes) [..., out, in] + ue8m0 bytes [..., out/block, in/block] -> fp32 [..., out, in].
    Tiles must cover whole blocks (out and in multiples of `block`)."""
    if codes.dtype != jnp.float8_e4m3fn:
        codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    s = e8m0_to_f32(scale_u8)                                            # [..., no, ni]
    rows = jnp.broadcast_to(s[..., None, :], s.shape[:-1] + (block, s.shape[-1]))   # no transpose: Mosaic GPU
    s = _repeat_last(rows.reshape(s.shape[:-2] + (s.shape[-2] * block, s.shape[-1])), block)
    return codes.astype(jnp.float32) * s


def dequant_fp4_weight(packed, scale_u8, block: int):
    """Packed e2m1 (two codes a byte, low nibble first) [..., out, in/2] + ue8m0 bytes [..., out, in/block]
    -> fp32 [..., out, in]."""
    p = _repeat_last(packed.astype(jnp.uint8), 2).astype(jnp.int32)           # byte j//2 at column j
    odd = jax.lax.broadcasted_iota(jnp.int32, p.shape, p.ndim - 1) & 1
    codes = (p >> (odd * 4)) & 0xF
    return fp4_code_to_f32(codes) * _repeat_last(e8m0_to_f32(scale_u8), block)


def dequant_weight(weight, scale, fmt: str, block: int):
    """A `Linear`'s stored weight (or a tile of it) -> fp32 values; 'bf16'/'f32' weights are just cast."""
    if fmt == "fp8":
        return dequant_fp8_weight(weight, scale, block)
    if fmt == "fp4":
        return dequant_fp4_weight(weight, scale, block)
    return weight.astype(jnp.float32)


def wgmma_smem(shape, dtype, swizzle=None):
    """An SMEM operand buffer for plgpu.wgmma: (8, swizzle/itemsize) tiles + the widest swizzle the minor dim
    allows (128, 64 or 32 bytes; the minor dim times the itemsize must be one of them or a multiple of 128)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    row_bytes = shape[-1] * jnp.dtype(dtype).itemsize
    swizzle = swizzle or next((s for s in (128, 64, 32) if row_bytes % s == 0), None)
    if swizzle is None:
        raise ValueError(f"wgmma operand {shape} {dtype}: minor dim must be a multiple of 32 bytes")
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


# ----------------------------------------------------------------------------- Triton-lowered kernels
# `pl.pallas_call` kernels lowered through Triton gather rows by index with pointer arithmetic (Hopper's TMA has
# no gather), which the sparse attention and the active-expert GEMM need. Loads index a whole ref with integer
# arrays only (broadcast together): that form lowers to one masked pointer load in Triton and runs in the HLO
# interpreter (which supports all-slice or all-array indexers, not a mix).


def triton_interpret(interpret):
    """`interpret` for Triton-lowered pallas_call: compile on a GPU, the HLO interpreter elsewhere (tests:
    outputs start as NaN, so an unwritten element shows)."""
    if interpret is not None:
        return interpret
    return jax.default_backend() != "gpu"


def triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plt
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (at least 1): Triton's ranges and register tiles are powers of two."""
    return 1 << max(0, (n - 1).bit_length())


def dot_tile(n: int) -> int:
    """The smallest tile of >= n rows `tl.dot` takes: a power of two, at least 16 (heads are padded to it)."""
    return max(16, 1 << math.ceil(math.log2(n)))


def iota(n: int, offset=0):
    """int32 [n]: offset, offset+1, ... (a Triton make_range)."""
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0) + offset


def gather(ref, *index, mask=None):
    """ref[index] for integer-array indices (broadcast together); masked-off elements read nothing and are 0."""
    from jax.experimental.pallas import triton as plt
    return plt.load(ref.at[tuple(index)], mask=mask, other=0 if mask is not None else None)


def main_row_pieces(kv_ref, b, rows, ok, fmt: MainRowFormat, width: int, dtype):
    """Gathered main-KV rows as value pieces [(column, [bk, width] dtype)], straight from the stored layout.

    kv_ref [B, N, R]: uint8 compact rows — V4's `MainRowFormat` (e4m3 codes x ue8m0 block scale, rope dims as
    little-endian bf16 byte pairs; V4.1's window rows are the same with no rope dims) or V4.1's `Fp4RowFormat`
    (packed e2m1 x e4m3 block scale) — or values (R = d). rows int32 [bk], ok bool [bk] (False: nothing read, zeros). Pieces are `width`
    columns wide (the FP8 block for compact rows), so no concatenation is needed in the kernel."""
    r2, m2, cols = rows[:, None], ok[:, None], iota(width)[None, :]
    if kv_ref.dtype != jnp.uint8:
        return [(c, gather(kv_ref, b, r2, cols + c, mask=m2).astype(dtype)) for c in range(0, kv_ref.shape[-1], width)]
    if isinstance(fmt, Fp4RowFormat):   # each logical column reads its byte, its nibble and its block's scale
        pieces = []
        for c in range(0, fmt.dim, width):
            col = cols + c
            packed = gather(kv_ref, b, r2, col // 2, mask=m2).astype(jnp.int32)
            code = (packed >> ((col & 1) * 4)) & 0xF
            scale = gather(kv_ref, b, r2, fmt.dim // 2 + col // fmt.block, mask=m2)
            scale = jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn).astype(jnp.float32)
            pieces.append((c, (fp4_code_to_f32(code) * scale).astype(dtype)))
        return pieces
    assert width == fmt.block and fmt.nope % width == 0 and fmt.rope % width == 0, (fmt, width)
    nb = fmt.nope // fmt.block
    pieces = []
    for j in range(nb):
        codes = gather(kv_ref, b, r2, cols + j * fmt.block, mask=m2)
        scale = e8m0_to_f32(gather(kv_ref, b, rows, fmt.nope + j, mask=ok))
        vals = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32) * scale[:, None]
        pieces.append((j * fmt.block, vals.astype(dtype)))
    base = fmt.nope + nb
    for c in range(0, fmt.rope, width):
        lo = gather(kv_ref, b, r2, base + 2 * (cols + c), mask=m2).astype(jnp.uint16)
        hi = gather(kv_ref, b, r2, base + 2 * (cols + c) + 1, mask=m2).astype(jnp.uint16)
        pieces.append((fmt.nope + c, jax.lax.bitcast_convert_type(lo | (hi << 8), jnp.bfloat16).astype(dtype)))
    return pieces


def dot_nt(a, b):
    """a [m, k] · b [n, k]ᵀ -> fp32 [m, n] (IEEE fp32 when the inputs are fp32: no TF32)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [m, k] · b [k, n] -> fp32 [m, n]."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def fp4_pieces(packed, j, scale, dtype):
    """Packed e2m1 bytes [rows, n] at byte columns j (logical columns 2j, 2j+1) sharing a per-row `scale` ->
    the even-column (low nibble) and odd-column (high nibble) value pieces as (columns, values, scale) triples:
    never interleaved, so no reshape or stack in a kernel."""
    packed = packed.astype(jnp.int32)
    return [(2 * j, fp4_code_to_f32(packed & 0xF).astype(dtype), scale),
            (2 * j + 1, fp4_code_to_f32(packed >> 4).astype(dtype), scale)]


def offsets_fit(a) -> bool:
    """Whether Pallas' Triton lowering indexes array `a` correctly: it computes element offsets in int32 unless
    the array holds more than 2^32 bytes, so an array of more than 2^31 elements within 2^32 bytes (1-byte codes:
    packed FP4 / FP8 weights, compact KV rows) wraps past 2^31 - 1 and reads out of bounds."""
    n = math.prod(a.shape)
    return n <= 2 ** 31 or n * jnp.dtype(a.dtype).itemsize > 2 ** 32


def check_offsets(name: str, *arrays) -> None:
    """A clear error instead of an illegal memory access (see `offsets_fit`)."""
    bad = [(tuple(a.shape), str(a.dtype)) for a in arrays if not offsets_fit(a)]
    if bad:
        raise ValueError(f"{name}: Pallas' Triton lowering would index {bad} with wrapping int32 offsets "
                         "(more than 2^31 elements in at most 2^32 bytes); use the xla implementation")


def every_bit(flag):
    """A u32 scalar of all ones where flag, else 0: a mask for `&` in Mosaic GPU kernels (their select does not
    broadcast a scalar predicate)."""
    return jnp.uint32(0) - flag.astype(jnp.uint32)


def fp4_words(w):
    """Packed e2m1 bytes uint8 [..., n] (n % 4 == 0) -> uint32 [..., n/4], the same bytes read as little-endian
    words (a bitcast, no copy). Kernels index weight stacks in words: Pallas' Triton lowering computes element
    offsets in int32 for arrays of at most 2^32 bytes, so a byte-indexed stack of 2^31 .. 2^32 bytes (V4.1-Flash's
    384 x 2304 x 2560 expert gate/up stacks) would wrap past 2^31 elements and read out of bounds."""
    return jax.lax.bitcast_convert_type(w.reshape(w.shape[:-1] + (w.shape[-1] // 4, 4)), jnp.uint32)


# FP4 -> bf16 on the GPU in a few integer ops per value (the e2m1 decode above costs ~16 and made the FP4 expert GEMM
# ALU-bound at decode, issue 8). Nibbles p and p + 4 of a 32-bit word lie 16 bits apart, as the two halves of a
# bf16 pair do: one shift puts both magnitudes (e1 e0 m) at bits 6-8 of their half, another both signs at bit 15.
# Read as bf16 that is m·2^-127 for e = 0 (a subnormal) and (1 + m/2)·2^(e-127) otherwise: times 2^126, the e2m1
# value, exactly (0 -> ±0 too). Then times the block scale (a power of two: exact). Two fma.bf16x2 per pair.
FP4_PAIR_MAGNITUDE, FP4_PAIR_SIGN = 0x01C001C0, 0x80008000
BF16X2_TWO_POW_126, BF16X2_NEG_ZERO = 0x7E807E80, 0x80008000


def fp4_pair_shifts(p: int) -> tuple[int, int]:
    """Left shifts (negative: right) moving nibble p's magnitude to bit 6 and its sign to bit 15."""
    return 6 - 4 * p, 12 - 4 * p


def fp4_pair_bits(words, p: int):
    """uint32 words -> uint32: bf16 pair bits (low half nibble p, high half nibble p + 4), before the 2^126
    multiply — the recipe `fp4_bf16_asm` runs, in jnp (tests check it for every code)."""
    sh = lambda w, n: (w << n) if n >= 0 else (w >> -n)  # noqa: E731
    m, s = fp4_pair_shifts(p)
    return (sh(words, m) & jnp.uint32(FP4_PAIR_MAGNITUDE)) | (sh(words, s) & jnp.uint32(FP4_PAIR_SIGN))


def _fp4_bf16_pair_ptx(p: int) -> str:
    """PTX: word $1, bf16 pair $2 holding the block scale twice (`bf16x2_scale`) -> $0 = bf16 pair (nibble p low,
    p + 4 high) times 2^126 times the scale."""
    m, s = fp4_pair_shifts(p)
    shift = lambda dst, n: f"{'shl' if n >= 0 else 'shr'}.b32 {dst}, $1, {abs(n)};"  # noqa: E731
    return "\n".join([
        "{", ".reg .b32 fq_m, fq_s, fq_p, fq_k, fq_z;",
        f"mov.b32 fq_k, {BF16X2_TWO_POW_126:#010x};", f"mov.b32 fq_z, {BF16X2_NEG_ZERO:#010x};",
        shift("fq_m", m), f"and.b32 fq_m, fq_m, {FP4_PAIR_MAGNITUDE:#010x};",
        shift("fq_s", s), f"and.b32 fq_s, fq_s, {FP4_PAIR_SIGN:#010x};",
        "or.b32 fq_p, fq_m, fq_s;",
        "fma.rn.bf16x2 fq_p, fq_p, fq_k, fq_z;", "fma.rn.bf16x2 $0, fq_p, $2, fq_z;", "}"])


def bf16x2_scale(scale):
    """fp32 power-of-two block scales -> int32 bf16 pairs holding the scale twice: the fp32 bits' high half is the
    exact bf16 (a power of two has no low bits, the subnormal 2^-127 included). Once a word, not once a pair."""
    b = jax.lax.bitcast_convert_type(scale, jnp.int32)
    return b | ((b >> 16) & 0xFFFF)


def _fp4_asm_pairs(words, scale):
    """The 4 int32 bf16 pairs (nibbles p, p + 4) of each word, scaled: one asm statement per pair (the Triton
    lowering takes one result per statement), its result signless int32 (Triton refuses an unsigned one: the H200's
    first run)."""
    from jax.experimental.pallas import triton as plt

    scale2 = bf16x2_scale(scale)
    return [plt.elementwise_inline_asm(_fp4_bf16_pair_ptx(p), args=[words, scale2], constraints="=r,r,r", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.int32)])[0]
            for p in range(4)]


def fp4_bf16_asm(words, scale):
    """uint32 words [r, c] of 8 e2m1 codes (low nibble first) and their fp32 block scales [r, c] -> 8 bf16 arrays
    [r, c], nibble position 0..7, each value times its scale. Compiled kernels only (PTX; sm_80+). The kernels'
    default (`fp4_asm`): bit-identical to the jnp decode on the H200, 1.26-1.33x faster at 1-8 tokens
    (docs/benchmarks.md)."""
    half = lambda b: jax.lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.bfloat16)  # noqa: E731
    out = [None] * 8
    for p, pair in enumerate(_fp4_asm_pairs(words, scale)):
        out[p], out[p + 4] = half(pair & 0xFFFF), half((pair >> 16) & 0xFFFF)   # int32 >> sign-extends: mask
    return out


def fp4_f32_values(words, scale, asm: bool):
    """uint32 words [r, c] of 8 e2m1 codes and fp32 block scales [r, c] -> 8 fp32 arrays [r, c] (nibble order),
    each value times its scale (exact). For fp32 multiply-adds (GEMV tiles): with asm the PTX pairs' bf16 halves
    become fp32 by one integer op each (a bf16 is the high half of its fp32), no convert; else the jnp decode."""
    if not asm:
        return [fp4_code_to_f32((words >> (4 * p)) & 0xF) * scale for p in range(8)]
    f32 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)  # noqa: E731
    out = [None] * 8
    for p, pair in enumerate(_fp4_asm_pairs(words, scale)):
        out[p], out[p + 4] = f32(pair << 16), f32(pair & jnp.int32(-65536))
    return out


def interleave_nibbles(values):
    """8 arrays [r, c] (nibble position p of word j = column 8j + p) -> [r, 8c] in column order, by joins (Triton
    stacks two arrays at a time, along a new last axis) and one reshape: the leaves go in bit-reversed nibble order,
    so the last join's axes (t, u, w) hold nibble 4t + 2u + w at column 8j + 4t + 2u + w. One [rows, chunk] MMA
    operand instead of eight 16-column ones — one layout change and one contiguous x load a chunk, not eight
    strided ones."""
    leaves = [values[int(f"{i:03b}"[::-1], 2)] for i in range(8)]         # v0 v4 v2 v6 v1 v5 v3 v7
    while len(leaves) > 1:
        leaves = [jnp.stack([a, b], axis=-1) for a, b in zip(leaves[0::2], leaves[1::2])]
    r, c = values[0].shape
    return leaves[0].reshape(r, 8 * c)


# FP4 -> FP8 e4m3 by moving bits (the tensor-core path, issue 8). An e2m1 code s|e1 e0|m placed as the e4m3 byte
# s|0 0 e1 e0|m 0 0 reads as the e2m1 value times 2^-6 — e4m3's exponent bias is 7 where e2m1's is 1, and e = 0
# lands on e4m3's subnormals with the same mantissa — for all 16 codes (±0 included; never a NaN byte). A word of 8
# codes gives two words of 4 e4m3 bytes (low nibbles, high nibbles): ~7 integer ops per 8 values, where the bf16
# decode costs ~28, and no float op at all. The 2^6 goes into the block scale, which multiplies the MMA's product.
FP4_E4M3_SIGN, FP4_E4M3_MAGNITUDE = 0x80808080, 0x1C1C1C1C
FP4_E4M3_UNSCALE = 64.0


def fp4_e4m3_words(words):
    """uint32 words of 8 e2m1 codes (low nibble first) -> (even, odd) uint32 words of 4 e4m3 bytes: byte t of even
    holds code 2t, of odd code 2t + 1, each worth the code's value times 2^-6."""
    sign, mag = jnp.uint32(FP4_E4M3_SIGN), jnp.uint32(FP4_E4M3_MAGNITUDE)
    return ((words << 4) & sign) | ((words << 2) & mag), (words & sign) | ((words >> 2) & mag)


def fp4_e4m3_values(words):
    """uint32 words [r, c] of 8 e2m1 codes -> float8_e4m3fn [r, 8c] in column order (code 8j + p at column 8j + p),
    each the code's value times 2^-6 (exact)."""
    even, odd = fp4_e4m3_words(words)
    byte = lambda w, t: jax.lax.bitcast_convert_type(((w >> (8 * t)) & 0xFF).astype(jnp.uint8),  # noqa: E731
                                                     jnp.float8_e4m3fn)
    return interleave_nibbles([byte(odd if p % 2 else even, p // 2) for p in range(8)])


def _fp4_e4m3_ptx(high: bool) -> str:
    """PTX: 4 packed code bytes $1 -> $0 = their low (or high) nibbles as e4m3 bytes."""
    sign, mag = f"{FP4_E4M3_SIGN:#010x}", f"{FP4_E4M3_MAGNITUDE:#010x}"
    t = ["and.b32 fe_t, $1, " + sign + ";", "shr.b32 fe_u, $1, 2;"] if high else [
        "shl.b32 fe_t, $1, 4;", f"and.b32 fe_t, fe_t, {sign};", "shl.b32 fe_u, $1, 2;"]
    return "\n".join(["{", ".reg .b32 fe_t, fe_u;", *t, f"and.b32 fe_u, fe_u, {mag};", "or.b32 $0, fe_t, fe_u;", "}"])


def fp4_e4m3_bytes(packed, asm: bool):
    """Packed e2m1 bytes uint8 [r, c] (low nibble first) -> float8_e4m3fn [r, 2c] in column order, each the code's
    value times 2^-6. asm (compiled kernels): two PTX statements per 4 bytes (the byte-parallel `fp4_e4m3_words`
    recipe); else the same bit moves in jnp, a byte at a time."""
    if asm:
        from jax.experimental.pallas import triton as plt
        even, odd = (plt.elementwise_inline_asm(  # one result a statement, signless (see `_fp4_asm_pairs`)
            _fp4_e4m3_ptx(high), args=[packed], constraints="=r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.int8)])[0] for high in (False, True))
    else:
        even = ((packed << 4) & 0x80) | ((packed << 2) & 0x1C)
        odd = (packed & 0x80) | ((packed >> 2) & 0x1C)
    f8 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)  # noqa: E731
    r, c = packed.shape
    return jnp.stack([f8(even), f8(odd)], axis=-1).reshape(r, 2 * c)


def fp4_e4m3_chunk(w_ref, s_ref, e, rows, k0, bk: int, block: int, asm: bool):
    """Rows `rows` x columns [k0, k0 + bk) of FP4 expert e as e4m3 codes [rows, bk] (values x 2^-6) and the scales
    of its bk / block scale blocks times 2^6, fp32 [rows, bk / block]. w_ref: the packed bytes or `fp4_words`."""
    r2 = rows[:, None]
    if w_ref.dtype == jnp.uint8:
        vals = fp4_e4m3_bytes(gather(w_ref, e, r2, (iota(bk // 2) + k0 // 2)[None, :]), asm)
    else:
        vals = fp4_e4m3_values(gather(w_ref, e, r2, (iota(bk // 8) + k0 // 8)[None, :]))
    scale = e8m0_to_f32(gather(s_ref, e, r2, (iota(bk // block) + k0 // block)[None, :])) * FP4_E4M3_UNSCALE
    return vals, scale


def weight_pieces(w_ref, s_ref, e, rows, k0, bk: int, fmt: str, block: int, dtype, asm: bool = False):
    """Rows `rows` x chunk [k0, k0+bk) of expert e of a stored `Linear` stack as (input columns, values
    [len(rows), len(columns)] in dtype, scale per row fp32 or None) triples: out += (x[:, cols] · valuesᵀ) · scale.

    FP8: a chunk lies inside one scale block (bk divides `block`); the ue8m0 scale (a power of two) multiplies
    the product, not the weights: exact, and one multiply per output instead of one per weight. FP4 (w_ref the
    `fp4_words` view, 8 codes a word, low nibble first): each value times its block's scale (exact: a power of
    two times an e2m1 value). Asked for fp32 (GEMV tiles' multiply-adds): one piece per nibble position p (columns
    8j + p of the chunk's words j, from `fp4_f32_values`, no bf16 step), each multiplied in place. Asked for bf16
    (MMA tiles): the eight interleaved back into the chunk's columns (`interleave_nibbles`), one operand. asm
    (compiled kernels): the values come from the PTX decode (~4 integer ops per value). Asked for e4m3 (FP8 tensor
    cores, FP8 activations): FP8 codes as they are, FP4 codes moved into e4m3 bytes (`fp4_e4m3_values`) one piece
    per scale block, the unscaled codes with their scale (times 2^6) to multiply each block's product."""
    r2 = rows[:, None]
    if fmt == "fp4" and dtype == jnp.float8_e4m3fn:     # FP8 tensor cores: one piece per scale block, unscaled codes
        if bk % block or block % 32:
            raise ValueError(f"FP4 weights as FP8 operands: chunk {bk} must hold whole scale blocks of 32k columns, "
                             f"got block {block}")
        out = []
        for k in [k0 + g * block for g in range(bk // block)]:
            vals, scale = fp4_e4m3_chunk(w_ref, s_ref, e, rows, k, block, block, asm)
            out.append((iota(block) + k, vals, scale.reshape(-1)))
        return out
    if fmt == "fp4":
        if block % 8 or bk % 8:
            raise ValueError(f"FP4 weights: scale block {block} and chunk {bk} must be multiples of 8 columns")
        jw = iota(bk // 8) + k0 // 8
        words = gather(w_ref, e, r2, jw[None, :])
        scale = e8m0_to_f32(gather(s_ref, e, r2, (jw * 8 // block)[None, :]))
        if dtype == jnp.float32:                     # GEMV multiply-adds: per nibble position, no bf16 step
            return [(8 * jw + p, v, None) for p, v in enumerate(fp4_f32_values(words, scale, asm))]
        values = fp4_bf16_asm(words, scale) if asm and dtype == jnp.bfloat16 else [
            v.astype(dtype) for v in fp4_f32_values(words, scale, False)]
        return [(iota(bk) + k0, interleave_nibbles(values), None)]     # one MMA operand, the chunk's own columns
    cols = iota(bk) + k0
    vals = gather(w_ref, e, r2, cols[None, :])
    vals = jax.lax.bitcast_convert_type(vals, dtype) if vals.dtype == jnp.uint8 else vals.astype(dtype)
    scale = e8m0_to_f32(gather(s_ref, e, rows // block, k0 // block)) if fmt == "fp8" else None
    return [(cols, vals, scale)]


def piece_width(kv, fmt, d: int) -> int:
    """Columns per value piece of a key tile: the FP8 block for compact rows, else 64 (or d when smaller)."""
    width = fmt.block if kv.dtype == jnp.uint8 and isinstance(fmt, MainRowFormat) else min(64, d)
    if d % width or width & (width - 1) or width < 16:
        raise ValueError(f"attention kernel: value dim {d} must split into power-of-two pieces >= 16 (got {width})")
    return width


def flash_scores(q_pieces, key_pieces, scale: float):
    """Σ over column pieces of q · keyᵀ: fp32 logits [rows, keys] (pieces avoid concatenating in a kernel)."""
    total = dot_nt(q_pieces[0], key_pieces[0])
    for qp, kp in zip(q_pieces[1:], key_pieces[1:]):
        total = total + dot_nt(qp, kp)
    return total * scale


def flash_init(rows: int, n_pieces: int, width: int):
    """Online-softmax carry: (running max -inf, running sum 0, one fp32 [rows, width] accumulator per piece)."""
    return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(n_pieces)))


def online_softmax(m, l, logits, ok):
    """One key block of an online softmax over fp32 logits [rows, bk] (ok broadcastable to them), from the running
    max m and sum l [rows]: (new max, the old accumulators' rescale alpha, the block's weights p, new sum). Rows
    that have seen no key keep max -inf and weight 0. Broadcasts are spelled out: shared by the Triton kernels
    (`flash_step`) and the Mosaic GPU chunk attention kernel, which has no implicit broadcasting. ok None: every
    logit visible (no mask). A masked logit is -inf, so its weight exp(-inf - finite max) is 0 without a second
    select."""
    if ok is not None:
        logits = jnp.where(ok, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(logits - jax.lax.broadcast_in_dim(m_safe, logits.shape, [0]))
    return m_new, alpha, p, alpha * l + jnp.sum(p, axis=1)


def flash_step(carry, logits, ok, value_pieces, dtype):
    """One key block of an online softmax (K = V): logits [rows, bk] fp32, ok broadcastable to it. As the
    reference, p is rounded to the compute dtype before P·V (relative to the running max)."""
    m, l, accs = carry
    m_new, alpha, p, l_new = online_softmax(m, l, logits, ok)
    pd = p.astype(dtype)
    accs = tuple(alpha[:, None] * a + dot_nn(pd, v) for a, v in zip(accs, value_pieces))
    return m_new, l_new, accs
