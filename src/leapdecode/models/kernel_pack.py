"""A weight in the GGUF's block form (``BlockWeight``: ``w[n, k] = s[n, g] * q[n, k] + z[n, g]`` for the group
``g`` of column ``k``) and the kernel's packed layout of it (``pack``, documented in ``kernels/qgemm.cpp``): the
code formats the kernel reads (``FORMAT_GROUPS``), rows padded to its 16-row units, and the forms its scales
can be stored in.  numpy and torch only: nothing here calls the library.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The code formats (kernels/qgemm.cpp): bit widths 2 (Q2_K), 3 (Q3_K), 4, 6 (stored codes of 5 and 6 bits) and 8,
# and CODES_IQ4: 4-bit indices into IQ4_NL's and IQ4_XS's 16 signed values (``IQ4_VALUES``), looked up by the kernel
CODES_IQ4 = 9
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
GROUPS = (16, 32)
FORMAT_GROUPS = {2: (16,), 3: (16,), 4: GROUPS, 6: GROUPS, 8: GROUPS, CODES_IQ4: (32,)}  # the groups each runs in
BITS = tuple(FORMAT_GROUPS)
FORMATS = tuple((bits, group) for bits, groups in FORMAT_GROUPS.items() for group in groups)
UNIT_BYTES = {2: 4, 3: 6, 4: 8, 6: 12, 8: 16, CODES_IQ4: 8}  # bytes of a 16-row unit's group, per column of it


def format_name(bits: int) -> str:
    return "IQ4 indices" if bits == CODES_IQ4 else f"{bits}-bit codes"


@dataclass
class BlockWeight:
    """One weight in block form: ``w = scales * codes + zeros`` per group of ``group`` columns.

    ``codes``: integer ``[N, K]`` (2-bit: 0..3; 4-bit: 0..15; 3-bit: 0..7 and 6-bit: 0..63 stored, value
    ``code - offset``; 8-bit: -128..127; ``CODES_IQ4``: indices 0..15, value ``IQ4_VALUES[code]``);
    ``scales``, ``zeros``: fp32 ``[N, K / group]``."""

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    group: int
    offset: int = 0
    # K-quants: scales = dsup * sc, zeros = zsup * mc per super-block of ``gps`` groups, kept
    # in that factored form by the kernel (int8 sc, mc [N, K/group]; dsup, zsup [N, K/group/gps],
    # fp16 values as the file stores them)
    factors: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def values(self) -> np.ndarray:
        """The integer values the codes stand for."""
        if self.bits == CODES_IQ4:
            return IQ4_VALUES[self.codes].astype(np.int32)
        return self.codes.astype(np.int32) - (self.offset if self.bits in (3, 6) else 0)

    def dequantize(self) -> np.ndarray:
        """fp32 ``[N, K]``: ``scale * value + zero`` (one rounding per product, one per sum)."""
        n, k = self.codes.shape
        v = self.values().astype(np.float32).reshape(n, k // self.group, self.group)
        return (self.scales[..., None] * v + self.zeros[..., None]).reshape(n, k)

    def rows(self, index: np.ndarray) -> "BlockWeight":
        """The weight with its output rows reordered by ``index``."""
        f = self.factors
        return BlockWeight(self.codes[index], self.scales[index], self.zeros[index], self.bits, self.group,
                           self.offset, None if f is None else (f[0][index], f[1][index], f[2][index], f[3][index], f[4]))


def padded(w: BlockWeight, multiple: int = 16) -> BlockWeight:
    """``w`` with zero rows (code 0, scale 0, zero 0: weight 0) up to a multiple of ``multiple``."""
    n = w.codes.shape[0]
    extra = -n % multiple
    if not extra:
        return w
    pad = lambda a, v=0: np.concatenate([a, np.full((extra,) + a.shape[1:], v, dtype=a.dtype)])  # noqa: E731
    code0 = w.offset if w.bits in (3, 6) else 0  # the code whose value is 0 (IQ4: none; the scale is 0)
    f = w.factors
    return BlockWeight(pad(w.codes, code0), pad(w.scales), pad(w.zeros), w.bits, w.group, w.offset,
                       None if f is None else (pad(f[0]), pad(f[1]), pad(f[2]), pad(f[3]), f[4]))


def _fp16_exact(a: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return bool(np.isfinite(h).all()) and np.array_equal(h.astype(np.float32), a.astype(np.float32))


def scale_forms(w: BlockWeight) -> tuple[bool, bool]:
    """Which forms of scales ``pack`` can store for ``w`` as they are: (the K-quants' fp16 factors and
    int8 sub-block scales, fp16 scales and zeros).  For a tensor packed a part at a time (its rows in
    chunks: a large tensor's temporaries stay small), every part's forms are gathered first and
    ``scale_mode`` picks the one the whole tensor can take, so each part is packed alike."""
    f = w.factors
    k_quant = f is not None and not (w.codes.shape[1] // w.group) % f[4] and _fp16_exact(f[2]) and _fp16_exact(f[3])
    return k_quant, _fp16_exact(w.scales) and _fp16_exact(w.zeros)


def scale_mode(forms: list[tuple[bool, bool]]) -> int:
    """The ``smode`` of a tensor whose parts can store ``forms`` (``scale_forms`` of each part): 2,
    the K-quants' factors; 1, fp16 scales and zeros; 0, fp32 ones."""
    if all(k_quant for k_quant, _ in forms):
        return 2
    return 1 if all(half for _, half in forms) else 0


def pack(w: BlockWeight, smode: int | None = None) -> dict[str, torch.Tensor]:
    """The kernel's layout of ``w`` (see kernels/qgemm.cpp): ``codes`` uint8, ``scales`` and
    ``zeros`` fp32 ``[N/16, K/group, 16]``, or in the form ``smode`` names (``scale_mode``; None: the
    most compact form ``w`` itself can take).  Rows are packed unit by unit (16 rows), so a tensor
    packed in chunks of rows (a multiple of 16) with one ``smode`` is the concatenation of its parts."""
    n, k = w.codes.shape
    g = w.group
    if g not in FORMAT_GROUPS.get(w.bits, ()) or n % 16 or k % g:
        raise ValueError(f"cannot pack a [{n}, {k}] weight with {format_name(w.bits)} in groups of {g}")
    k_quant, half = scale_forms(w)
    if smode is None:
        smode = scale_mode([(k_quant, half)])
    elif not (smode == 0 or smode == 1 and half or smode == 2 and k_quant):
        raise ValueError(f"cannot store this weight's scales in mode {smode!r}")
    ng = k // g
    if w.bits == 8:  # signed values stored as value + 128 (unsigned bytes for vpdpbusd)
        c = (w.codes.astype(np.int16) + 128).astype(np.uint8)
    else:
        c = w.codes.astype(np.uint8, copy=False)
    # [u, j, g, q, t] -> [u, g, q, j, t]: quad vector q of unit u, group g holds (n = j, k = 4q + t)
    c = c.reshape(n // 16, 16, ng, g // 4, 4).transpose(0, 2, 3, 1, 4).reshape(n // 16, ng, g // 4, 64)
    if w.bits in (2, 3):  # 2 bits a code, four quad vectors a byte; then 3-bit codes' third bits, 8 bytes a quad
        lo = (c & 3).reshape(n // 16, ng, g // 16, 4, 64)
        lo = (lo[:, :, :, 0] | (lo[:, :, :, 1] << 2) | (lo[:, :, :, 2] << 4) | (lo[:, :, :, 3] << 6))
        c2 = lo.astype(np.uint8).reshape(n // 16, ng, -1)
        if w.bits == 3:
            third = np.packbits((c >> 2) & 1, axis=-1, bitorder="little").reshape(n // 16, ng, -1)
            c2 = np.concatenate([c2, third], axis=-1)
        c = c2
    elif w.bits in (4, 6, CODES_IQ4):
        lo = (c & 15).reshape(n // 16, ng, g // 8, 2, 64)
        lo = (lo[:, :, :, 0, :] | (lo[:, :, :, 1, :] << 4)).astype(np.uint8).reshape(n // 16, ng, -1)
        if w.bits != 6:
            c = lo
        else:  # then the high 2 bits, four quad vectors a byte
            hi = (c >> 4).reshape(n // 16, ng, g // 16, 4, 64)
            hi = (hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6))
            c = np.concatenate([lo, hi.astype(np.uint8).reshape(n // 16, ng, -1)], axis=-1)

    def units(a: np.ndarray, dtype) -> torch.Tensor:  # [N, G] -> [N/16, G, 16]
        cols = a.shape[1]
        return torch.from_numpy(np.ascontiguousarray(a.astype(dtype).reshape(n // 16, 16, cols).transpose(0, 2, 1)))

    out = {"codes": torch.from_numpy(np.ascontiguousarray(c).reshape(-1))}
    f = w.factors
    if smode == 2:
        sc, mc, dsup, zsup, gps = f  # the K-quants: fp16 d, dmin and int8 sub-block scales, as in the file
        out.update(scales=units(sc, np.int8), zeros=units(mc, np.int8), dsup=units(dsup, np.float16),
                   zsup=units(zsup, np.float16), smode=2, gps=gps)
    elif smode == 1:
        out.update(scales=units(w.scales, np.float16), zeros=units(w.zeros, np.float16), smode=1, gps=1)
    else:
        out.update(scales=units(w.scales, np.float32), zeros=units(w.zeros, np.float32), smode=0, gps=1)
    return out
