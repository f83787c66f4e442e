"""leapdecode's own batch-invariant kernels as torch modules and ops: the quantized linear layer
(``QPart``, ``QLinear``), the attention, rope-and-store, RMSNorm and SiLU calls, and a decoder's layers in
one call (``LayerStack``).  Each calls the library (``kernel_library.library()``, looked up at every call).

A weight is kept in the GGUF's block form, ``w[n, k] = s[n, g] * q[n, k] + z[n, g]`` for the
group ``g`` of column ``k`` (group 16 or 32), with the codes ``q`` as they are in the file
(2-, 3-, 4-, 6- or 8-bit, or IQ4's 4-bit indices into its table of 16 values) and the scale ``s``
and offset ``z`` exact in fp32 (the GGUF's own products ``d * sc`` and ``dmin * m``).  So a Q2_K /
Q3_K / Q4_K / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 / IQ4_NL / IQ4_XS tensor runs with
exactly the weights llama.cpp dequantizes, at about the file's bits a weight, without re-quantizing.

Activations are quantized the way llama.cpp quantizes them for these formats: each row's bf16
values to int8 per group of 16/32 columns (``x ~ dx * xq``, ``dx = max|x| / 127``); the dot
products of codes and ``xq`` are exact integers (``vpdpbusd`` with AVX512-VNNI, ``vpmaddubsw``
with AVX2, or portable C++: the same bits on each), scaled per group in fp32.  So a layer's output differs from
``x @ w.T`` in fp32 by the activation rounding (about 0.5% of its largest output on random
data; docs/lab-notes/benchmarks.md measures the effect on the model's NLL), and every output element is
computed by the same operations whatever the number of rows: a token's result does not depend
on how many tokens share the forward (tests/test_qkernel.py checks it bitwise).

The rest of the kernel lives beside this module: ``kernel_library`` builds the library at first use (or picks
a prebuilt variant), caches, loads and binds it and says why it cannot run (``kernel_problem``);
``kernel_pack`` holds the block form (``BlockWeight``) and its packed layout (``pack``); ``kernel_prefill``
chooses a layer's prefill path (the kernel or a bf16 copy, ``DENSE_BUDGET``); ``kernel_build`` and
``kernel_abi`` hold the sources and flags, and the binding declared by ``kernels/ld_abi.h``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import time

import numpy as np
import torch
from torch import nn

from ..errors import ModelFileError
from . import kernel_abi, kernel_library, kernel_pack, kernel_prefill
from .linear import make_linear

MAX_ROWS = 64  # the kernel's rows per pass (kernels/qgemm.cpp MAX_ROWS)


# --------------------------------------------------------------------------- the layer
_THREAD = threading.local()  # each thread's work buffer for the kernel (reused across calls)


def _work_buffer(nbytes: int) -> torch.Tensor:
    """This thread's scratch bytes for ``ld_qgemm`` (quantized activations), grown when needed."""
    buf = getattr(_THREAD, "work", None)
    if buf is None or buf.numel() < nbytes:
        buf = _THREAD.work = torch.empty(nbytes, dtype=torch.uint8)
    return buf


class QPart(nn.Module):
    """One packed block-quantized weight ``[out_features, in_features]``."""

    SCALE_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.int8}

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
                 offset: int, out_features: int, in_features: int, dsup: torch.Tensor | None = None,
                 zsup: torch.Tensor | None = None, smode: int = 0, gps: int = 1) -> None:
        super().__init__()
        self.bits, self.group, self.offset = int(bits), int(group), int(offset)
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.smode, self.gps = int(smode), int(gps)
        units, ng = out_features // 16, in_features // group
        per_group = kernel_pack.UNIT_BYTES.get(bits, 16) * group
        problem = None
        if group not in kernel_pack.FORMAT_GROUPS.get(bits, ()) or out_features % 16 or in_features % group:
            problem = f"{kernel_pack.format_name(bits)} in groups of {group} do not fit its shape"
        elif codes.numel() != units * ng * per_group or scales.shape != (units, ng, 16) or zeros.shape != scales.shape:
            problem = "its tensors have the wrong sizes"
        elif self.smode not in self.SCALE_DTYPES or scales.dtype != self.SCALE_DTYPES[self.smode] \
                or zeros.dtype != scales.dtype:
            problem = f"scale mode {smode} with {scales.dtype} scales"
        elif self.smode == 2 and (dsup is None or zsup is None or self.gps <= 0 or ng % self.gps
                                  or dsup.shape != (units, ng // self.gps, 16) or zsup.shape != dsup.shape
                                  or dsup.dtype != torch.float16 or zsup.dtype != torch.float16):
            problem = "its super-block scales have the wrong sizes"
        if problem:
            raise ModelFileError(f"packed weight [{out_features}, {in_features}]: {problem}")
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        self.register_buffer("dsup", None if dsup is None else dsup.contiguous())
        self.register_buffer("zsup", None if zsup is None else zsup.contiguous())

    @classmethod
    def from_block(cls, w: kernel_pack.BlockWeight) -> "QPart":
        """Pack ``w``; rows are padded with zero weights to a multiple of 16 (``QLinear`` drops them)."""
        w = kernel_pack.padded(w)
        p = kernel_pack.pack(w)
        n, k = w.shape
        return cls(p["codes"], p["scales"], p["zeros"], w.bits, w.group, w.offset, n, k, p.get("dsup"),
                   p.get("zsup"), p["smode"], p["gps"])

    def spec(self) -> dict:
        """What ``__init__`` needs besides the tensors (for the packed-weights cache)."""
        return {"bits": self.bits, "group": self.group, "offset": self.offset, "smode": self.smode,
                "gps": self.gps, "out_features": self.out_features, "in_features": self.in_features}

    def pointers(self) -> tuple:
        """The kernel's weight arguments, from ``codes`` to ``group``.  A K-quant weight whose
        offsets are all +0 (Q6_K) goes in as scale mode 3: the same values, but the kernel's
        SIMD path then skips the offsets' bytes (kernels/qgemm.cpp)."""
        smode = self.smode
        if smode == 2 and not bool(self.zsup.view(torch.int16).any()):
            smode = 3
        return (self.codes.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr(),
                None if self.dsup is None else self.dsup.data_ptr(),
                None if self.zsup is None else self.zsup.data_ptr(),
                smode, self.gps, self.bits, self.offset, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out, in]``: the weight the kernel multiplies by, in fp32 (``s * value + z``), or
        rounded to bf16 in the same pass (``dtype=torch.bfloat16``: the prefill path's copy)."""
        fn = {torch.float32: "ld_qdequant", torch.bfloat16: "ld_qdequant_bf16"}.get(dtype)
        if fn is None:
            raise ValueError(f"dequantize to fp32 or bf16, not {dtype}")
        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        rc = getattr(kernel_library.library(), fn)(*self.pointers(), self.out_features, self.in_features,
                                                   out.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"{fn} failed ({rc})")
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros, self.dsup, self.zsup)
                   if t is not None)

    def take_units(self, units: slice | torch.Tensor) -> "QPart":
        """The rows of some of its 16-row units as a part of their own: a ``slice`` of units gives
        views of this part's tensors (no copy), a tensor of unit indices a gathered copy.  Every
        output column of the kernel depends on its own unit alone, so the new part's outputs are
        the same bits as this part's for the same rows."""
        n_units = self.out_features // 16

        def take(t: torch.Tensor | None) -> torch.Tensor | None:  # every tensor is unit-major
            return None if t is None else t.reshape(n_units, -1)[units].reshape(-1, *t.shape[1:])

        scales = take(self.scales)  # [kept units, groups, 16]
        return QPart(take(self.codes), scales, take(self.zeros), self.bits, self.group, self.offset,
                     16 * scales.shape[0], self.in_features, take(self.dsup), take(self.zsup), self.smode, self.gps)


class QLinear(nn.Module):
    """A linear layer on block-quantized weights: the parts' outputs side by side (e.g. q, k, v
    with their own GGUF block types in one fused projection), plus an fp32 bias.

    Input: bf16 (other dtypes are cast); output: bf16, or fp32 with ``out_fp32`` (the head).
    ``out_features`` (default: all the parts' rows) drops the zero rows that padded the last
    part to a multiple of 16."""

    def __init__(self, parts: list[QPart], bias: torch.Tensor | None = None, out_fp32: bool = False,
                 out_features: int | None = None) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("QLinear needs parts with one in_features")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.padded_features = sum(p.out_features for p in parts)
        self.out_features = self.padded_features if out_features is None else int(out_features)
        if not self.padded_features - parts[-1].out_features < self.out_features <= self.padded_features:
            raise ValueError(f"out_features {self.out_features} does not fit parts of {self.padded_features} rows")
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], not {tuple(bias.shape)}")
        if bias is not None and self.padded_features != self.out_features:
            bias = torch.cat([bias.float(), bias.new_zeros(self.padded_features - self.out_features).float()])
        self.out_fp32 = bool(out_fp32)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._dense: tuple[nn.Module, torch.Tensor | None] | None = None
        self._on_dense: bool | None = None  # kernel_prefill.prefill_on_dense, decided on the first large forward
        self._work: int | None = None  # bytes of the kernel's work buffer (ld_work_bytes), asked on first use
        self._call_args: list[tuple] | None = None  # _calls(), built on first use

    def dense(self) -> tuple[nn.Module, torch.Tensor | None]:
        """The same weights dequantized to a bf16 (oneDNN-packed) linear layer, built on first use
        and kept: the prefill path for forwards of more than ``kernel_prefill.DENSE_MIN_ROWS`` rows."""
        if self._dense is None:
            weight = torch.cat([p.dequantize(torch.bfloat16) for p in self.parts])[:self.out_features]
            layer = make_linear(weight)
            self._dense = (layer, None if self.bias is None else self.bias[:self.out_features])
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, rowwise=False)

    def prefills_on_dense(self) -> bool:
        """Whether a forward of more than ``kernel_prefill.DENSE_MIN_ROWS`` rows runs on the bf16 copy
        (``kernel_prefill.prefill_on_dense``, from ``measure_prefill_ratio``'s ratios, and its bytes fit
        ``kernel_prefill.DENSE_BUDGET``: decided once and kept)."""
        if self._on_dense is None:
            self._on_dense = (kernel_prefill.prefill_on_dense(self.parts, measure_prefill_ratio)
                              and kernel_prefill.DENSE_BUDGET.take(self, 2 * self.out_features * self.in_features))
        return self._on_dense

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` on the batch-invariant kernel whatever the number of rows (never the bf16
        prefill copy): the rows of several sequences side by side (``native.rowwise_linear``)."""
        return self._forward(x, rowwise=True)

    def _forward(self, x: torch.Tensor, rowwise: bool) -> torch.Tensor:
        lib = kernel_library.library()
        k = self.in_features
        if x.shape[-1] != k:
            raise ValueError(f"QLinear takes rows of {k} values, got a tensor of shape {tuple(x.shape)}")
        # a contiguous bf16 input (every decoding step's) goes to the kernel as it is: no reshapes
        # (Python work was ~16 us of a small layer's ~26 us call)
        x2 = x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.reshape(-1, k).to(torch.bfloat16).contiguous()
        m = x2.numel() // k if k else 0
        if m > kernel_prefill.DENSE_MIN_ROWS and not self.out_fp32 and not rowwise and self.prefills_on_dense():
            # (the head keeps fp32 logits: always the kernel)
            layer, bias = self.dense()
            y = layer(x2.reshape(-1, k))
            if bias is not None:
                y = (y.float() + bias).to(torch.bfloat16)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        y = torch.empty(*x.shape[:-1], self.padded_features, dtype=torch.float32 if self.out_fp32 else torch.bfloat16)
        esize = y.element_size()
        if self._work is None:  # the kernel's quantized rows, scales and sums
            self._work = max(lib.ld_work_bytes(k, p.group) for p in self.parts)
        work = _work_buffer(self._work).data_ptr()
        xp, yp, threads, out_fp32 = x2.data_ptr(), y.data_ptr(), torch.get_num_threads(), int(self.out_fp32)
        for weights, n, bias, n0 in self._calls():
            rc = lib.ld_qgemm(xp, m, k, k, *weights, n, bias, yp + esize * n0, self.padded_features, out_fp32, threads,
                              work)
            if rc:
                raise RuntimeError(f"ld_qgemm failed ({rc}) on a [{n}, {k}] part")
        if self.padded_features != self.out_features:
            y = y[..., :self.out_features]
        return y if self.out_fp32 or x.dtype == torch.bfloat16 else y.to(x.dtype)

    def _apply(self, fn, recurse=True):
        # the buffers may move (``module.to()``, ``share_memory()``...): the kernel arguments are
        # built again on the next call
        self._call_args = None
        return super()._apply(fn, recurse)

    def _calls(self) -> list[tuple]:
        """Per part, the kernel's weight arguments, its rows, its bias pointer and its first output
        column; built on first use and again after the buffers moved (``_apply``).  (Checking the
        buffers' addresses on every call cost ~10% of a small model's decoding step.)"""
        if self._call_args is None:
            calls, n0 = [], 0
            for p in self.parts:
                bias = self.bias.data_ptr() + 4 * n0 if self.bias is not None else None
                calls.append((p.pointers(), p.out_features, bias, n0))
                n0 += p.out_features
            self._call_args = calls
        return self._call_args

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[out_features, in_features]``: the weight the kernel multiplies by."""
        return torch.cat([p.dequantize() for p in self.parts])[:self.out_features]

    def first_rows(self, n: int) -> "QLinear":
        """Its first ``n`` output rows as a layer of their own, on views of its tensors (no copy):
        e.g. FR-Spec's frequency-ranked subset of an output head.  Its outputs are the same bits as
        this layer's first ``n`` (the kernel computes each 16-row unit on its own)."""
        if not 0 < n <= self.out_features:
            raise ValueError(f"first_rows({n}) of a layer of {self.out_features} rows")
        parts, left = [], n
        for p in self.parts:
            if left <= 0:
                break
            parts.append(p if left >= p.out_features else p.take_units(slice(0, -(-left // 16))))
            left -= p.out_features
        return QLinear(parts, None if self.bias is None else self.bias[:n], out_fp32=self.out_fp32, out_features=n)

    def gather_rows(self, ids: torch.Tensor) -> tuple["QLinear", torch.Tensor]:
        """A layer over the 16-row units that hold the output rows ``ids`` (copies of those units),
        and the columns of its output that are those rows, in the order of ``ids``: its outputs
        there are the same bits as this layer's."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.out_features:
            raise ValueError(f"gather_rows: ids must be rows 0..{self.out_features - 1}")
        parts, cols, start, taken = [], torch.empty_like(ids), 0, 0
        for p in self.parts:
            local = ids - start
            here = (local >= 0) & (local < p.out_features)
            if here.any():
                units, where = torch.unique(local[here] // 16, return_inverse=True)
                parts.append(p.take_units(units))
                cols[here] = taken + 16 * where + local[here] % 16
                taken += 16 * int(units.numel())
            start += p.out_features
        bias = None
        if self.bias is not None:
            bias = torch.zeros(taken)
            bias[cols] = self.bias[ids]
        return QLinear(parts, bias, out_fp32=self.out_fp32), cols

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p.out_features}x{p.bits}b/g{p.group}" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{kinds}]"


# --------------------------------------------------------------------------- the prefill path's measurement
# (what ``kernel_prefill.prefill_ratios`` is measured with, passed in by ``QLinear.prefills_on_dense``: the layer
# above on the kernel and on its bf16 copy)
PREFILL_PROBE = (128, 2048, 2048)  # rows, columns in, columns out of the measured product


def _probe_weight(bits: int, group: int) -> kernel_pack.BlockWeight:
    rows, k, n = PREFILL_PROBE
    rng = np.random.default_rng(0)
    top = {2: 4, 3: 8, 4: 16, 6: 64, 8: 256, kernel_pack.CODES_IQ4: 16}[bits]
    codes = rng.integers(0, top, size=(n, k)) - (128 if bits == 8 else 0)
    scales = (rng.random((n, k // group), dtype=np.float32) * 0.01).astype(np.float32)
    zeros = -(scales * (top // 2)).astype(np.float32) if bits in (2, 4) else np.zeros_like(scales)
    return kernel_pack.BlockWeight(codes.astype(np.int16 if bits == 8 else np.uint8), scales, zeros, bits, group,
                                   top // 2 if bits in (3, 6) else 0)


def measure_prefill_ratio(bits: int, group: int, rounds: int = 5) -> float:
    """Seconds of a ``PREFILL_PROBE`` product on the kernel over seconds of the same product on a
    bf16 copy of the weight through torch (oneDNN), min over interleaved rounds after a warm-up."""
    layer = QLinear([QPart.from_block(_probe_weight(bits, group))])
    dense, _ = layer.dense()
    x = torch.randn(PREFILL_PROBE[0], PREFILL_PROBE[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    best = {"kernel": float("inf"), "dense": float("inf")}
    for r in range(rounds + 1):
        for path, fn in (("kernel", lambda: layer.rowwise(x)), ("dense", lambda: dense(x))):
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if r:
                best[path] = min(best[path], dt)
    return best["kernel"] / best["dense"]


# --------------------------------------------------------------------------- attention
ATTENTION_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def attention_supported(q: torch.Tensor, keys: torch.Tensor, n_heads: int | None = None) -> bool:
    """Whether ``attend_rows`` takes these tensors (CPU, fp32/bf16, one sequence, head sizes that
    are multiples of 16 up to 256, at most 16 query heads per key head) and the kernel is built.
    ``q``: the queries ``[1, Hq, T, D]``, or (with ``n_heads``) any tensor of their dtype and device."""
    hq = q.shape[1] if n_heads is None else n_heads
    d = keys.shape[-1]
    return (q.device.type == "cpu" and q.dtype in ATTENTION_DTYPES and keys.dtype == q.dtype
            and (n_heads is not None or q.shape[0] == 1) and keys.shape[0] == 1 and d % 16 == 0 and d <= 256
            and hq % keys.shape[1] == 0 and hq // keys.shape[1] <= 16 and kernel_library.kernel_problem() is None)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, flat: torch.Tensor,
                offsets: torch.Tensor, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Batch-invariant attention (``kernels/attention.cpp``): query row ``t`` of ``q``
    (``[1, Hq, T, D]``) attends over the slots ``flat[offsets[t]:offsets[t + 1]]`` of ``keys`` /
    ``values`` (``[1, Hkv, slots, D]``), in that order, with ``scale`` (None: ``1/sqrt(D)``); the query heads
    of a key head share it (grouped-query attention); ``softcap``: each score s becomes
    ``tanh(s / softcap) * softcap`` (Gemma 2).  Returns ``[1, T, Hq * D]`` in ``q``'s dtype.
    A row's result does not depend on the other rows (same operations, no shared sums)."""
    _, hq, t, d = q.shape
    hkv = keys.shape[1]
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("attend_rows needs the head dimension contiguous")
    if flat.dtype != torch.int64 or offsets.dtype != torch.int64 or offsets.numel() != t + 1:
        raise ValueError("attend_rows needs int64 slots and T + 1 offsets")
    out = torch.empty(1, t, hq * d, dtype=q.dtype)
    rc = kernel_library.library().ld_attend_rows(q.data_ptr(), q.stride(2), q.stride(1), keys.data_ptr(),
                                                 keys.stride(1), keys.stride(2), values.data_ptr(), values.stride(1),
                                                 values.stride(2), flat.data_ptr(), offsets.data_ptr(), t, hq, hkv, d,
                                                 ATTENTION_DTYPES[q.dtype],
                                                 1.0 / math.sqrt(d) if scale is None else scale, softcap or 0.0,
                                                 out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"ld_attend_rows failed ({rc}) for {hq} query heads, {hkv} key heads, head size {d}")
    return out


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor | None:
    """RMSNorm of bf16 CPU rows in one call of ``kernels/attention.cpp``'s ``ld_rmsnorm_bf16``
    (the Llama/Qwen2 roundings, a fixed-order sum per row; ``plus_one``: ``ld_rmsnorm1p_bf16``, Gemma's
    ``x * rsqrt(...) * (1 + w)`` in fp32, rounded once), or None where it does not apply (other dtypes
    or devices, a row length that is not a multiple of 16, no kernel)."""
    k = x.shape[-1]
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu" or k % 16
            or weight.shape != (k,) or x.stride(-1) != 1 or not weight.is_contiguous()
            or kernel_library.kernel_problem() is not None):
        return None
    if x.is_contiguous():  # the decoding steps' case, without the reshapes (~5 us of a ~20 us call)
        x2, rows, ldx = x, x.numel() // k if k else 0, k
    else:
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            return None
        rows, ldx = x2.shape[0], x2.stride(0)
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    fn = kernel_library.library().ld_rmsnorm1p_bf16 if plus_one else kernel_library.library().ld_rmsnorm_bf16
    rc = fn(x2.data_ptr(), rows, k, ldx, weight.data_ptr(), eps, y.data_ptr(), k)
    if rc:
        raise RuntimeError(f"ld_rmsnorm_bf16 failed ({rc})")
    return y


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
               keys: torch.Tensor, values: torch.Tensor, slot0: int) -> torch.Tensor:
    """One sequence's new tokens (``qkv``: ``[1, T, (Hq + 2 Hkv) * D]``, contiguous rows): rotary
    embedding of queries and keys (``cos``/``sin``: ``[T, D]``), keys and values stored at slots
    ``slot0..slot0+T-1`` of one layer's cache (``keys``/``values``: ``[1, Hkv, slots, D]`` views),
    with the roundings of ``native.apply_rope`` and ``KVCache.write``; returns the queries as
    ``[1, Hq, T, D]`` (a view of a ``[T, Hq, D]`` tensor), ready for ``attend_rows``."""
    _, t, width = qkv.shape
    d = keys.shape[-1]
    if (qkv.stride(-1) != 1 or qkv.stride(1) != width or cos.shape != (t, d) or sin.shape != (t, d)
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype
            or width != (n_heads + 2 * n_kv_heads) * d or keys.stride(-1) != 1 or values.stride(-1) != 1):
        raise ValueError("rope_store: unexpected shapes or layouts")
    q = torch.empty(t, n_heads, d, dtype=qkv.dtype)
    rc = kernel_library.library().ld_rope_store(qkv.data_ptr(), t, width, cos.data_ptr(), sin.data_ptr(), n_heads,
                                                n_kv_heads, d, ATTENTION_DTYPES[qkv.dtype], q.data_ptr(),
                                                keys.data_ptr(), keys.stride(1), keys.stride(2), values.data_ptr(),
                                                values.stride(1), values.stride(2), slot0)
    if rc:
        raise RuntimeError(f"ld_rope_store failed ({rc})")
    return q.view(1, t, n_heads, d).transpose(1, 2)


def rope_attend_segments(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_start: torch.Tensor,
                         kv: torch.Tensor, flat: torch.Tensor, offsets: torch.Tensor, n_heads: int,
                         n_kv_heads: int) -> torch.Tensor:
    """Several sequences' new tokens of one layer in one call (``kernels/attention.cpp``
    ``ld_rope_attend_segments``): rows ``seg_start[s]:seg_start[s + 1]`` of ``qkv``
    (``[1, N, (Hq + 2 Hkv) * D]``, unit column stride) and ``cos``/``sin`` (``[N, D]``) are sequence
    s's, rotated and stored into its cache as ``rope_store`` does (``kv``: int64 ``[S, 7]``, per
    sequence the layer's key address, key head and slot strides, value address and strides, first
    new slot), then attended as ``attend_rows`` does (``flat``/``offsets``: every row's slots,
    offsets over all N rows).  Returns ``[1, N, Hq * D]``: each row the bits of its own sequence's
    ``rope_store`` + ``attend_rows``."""
    _, n, width = qkv.shape
    d = cos.shape[-1]
    if (qkv.stride(-1) != 1 or cos.shape != (n, d) or sin.shape != (n, d) or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype
            or width != (n_heads + 2 * n_kv_heads) * d or kv.dtype != torch.int64 or not kv.is_contiguous()
            or seg_start.dtype != torch.int64 or flat.dtype != torch.int64 or offsets.dtype != torch.int64
            or offsets.numel() != n + 1 or kv.shape != (seg_start.numel() - 1, 7)):
        raise ValueError("rope_attend_segments: unexpected shapes or layouts")
    q = torch.empty(n, n_heads, d, dtype=qkv.dtype)
    out = torch.empty(1, n, n_heads * d, dtype=qkv.dtype)
    rc = kernel_library.library().ld_rope_attend_segments(qkv.data_ptr(), n, qkv.stride(1), cos.data_ptr(),
                                                          sin.data_ptr(), kv.shape[0], seg_start.data_ptr(),
                                                          kv.data_ptr(), flat.data_ptr(), offsets.data_ptr(), n_heads,
                                                          n_kv_heads, d, ATTENTION_DTYPES[qkv.dtype],
                                                          1.0 / math.sqrt(d), q.data_ptr(), out.data_ptr(),
                                                          torch.get_num_threads())
    if rc:
        raise RuntimeError(f"ld_rope_attend_segments failed ({rc})")
    return out


# --------------------------------------------------------------------------- a decoder's layers
# kernels/layers.cpp's structs, as ld_abi.h declares them: one packed part as ld_qgemm takes it, a QLinear's
# parts, a layer, and what the layers share
LdPart, LdLinear, LdLayer, LdStack = (kernel_abi.abi().structs[n] for n in ("LdPart", "LdLinear", "LdLayer", "LdStack"))


@functools.lru_cache(maxsize=None)
def silu_table() -> torch.Tensor:
    """``F.silu`` of every bf16 value as torch computes and rounds it on this CPU, as 16-bit
    patterns indexed by the input's bits, with two spare entries (``layers.cpp`` reads 4 bytes per
    entry).  Computed in calls of 16384 values: below torch's parallel grain, a whole number of
    vectors, so every value takes torch's vectorized path (which SiLU on rows of a multiple of 32
    values takes too; torch's scalar path for the odd tail of a row or thread chunk may round
    otherwise: the table gives every position the same result)."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    y = torch.cat([torch.nn.functional.silu(c) for c in x.split(16384)]).view(torch.int16)
    return torch.cat([y, y.new_zeros(2)])


@functools.lru_cache(maxsize=None)
def gelu_tanh_table() -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` of every bf16 value as torch computes it here (Gemma's
    activation), laid out as ``silu_table``."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    y = torch.cat([torch.nn.functional.gelu(c, approximate="tanh") for c in x.split(16384)]).view(torch.int16)
    return torch.cat([y, y.new_zeros(2)])


def silu_mul(gate: torch.Tensor, up: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.silu(gate) * up`` for bf16 CPU rows (``gate``/``up``: ``[..., I]`` views whose last
    dimension is contiguous and whose rows are equally spaced, e.g. the two halves of a fused
    gate-up projection) in one call of ``kernels/layers.cpp``: torch's SiLU bits from
    ``silu_table``, the product rounded once as torch's bf16 multiply rounds it.  None where it
    does not apply (other dtypes or devices, other layouts, no kernel).  ``table``: another activation's
    table (``gelu_tanh_table``) in place of SiLU's."""
    if (gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16 or gate.shape != up.shape
            or gate.device.type != "cpu" or up.device.type != "cpu" or gate.dim() < 1
            or gate.stride(-1) != 1 or up.stride(-1) != 1 or kernel_library.kernel_problem() is not None):
        return None
    n = gate.shape[-1]
    rows = gate.numel() // n if n else 0
    g2, u2 = gate.reshape(-1, n) if rows else gate, up.reshape(-1, n) if rows else up
    if rows and (g2.stride(-1) != 1 or u2.stride(-1) != 1 or (rows > 1 and g2.stride(0) != u2.stride(0))):
        return None
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    if rows:
        rc = kernel_library.library().ld_silu_mul_bf16((silu_table() if table is None else table).data_ptr(),
                                                       g2.data_ptr(), u2.data_ptr(), rows,
                                                       g2.stride(0) if rows > 1 else n, n, out.data_ptr())
        if rc:
            raise RuntimeError(f"ld_silu_mul_bf16 failed ({rc})")
    return out


def _ld_linear(layer: QLinear, keep: list) -> LdLinear:
    parts = (LdPart * len(layer.parts))()
    for i, (weights, n, bias, n0) in enumerate(layer._calls()):
        codes, scales, zeros, dsup, zsup, smode, gps, bits, offset, group = weights
        parts[i] = LdPart(codes, scales, zeros, dsup, zsup, bias, smode, gps, bits, offset, group, n, n0)
    keep.append(parts)
    return LdLinear(parts, len(layer.parts), layer.in_features, layer.padded_features)


def _with_qk_norms(layers: list[tuple]) -> list[tuple]:
    """``LayerStack``'s layer tuples in full: (wqkv, wo, w_gate_up, w_down, attn_norm, mlp_norm, q_norm, k_norm,
    post_attn_norm, post_mlp_norm, window), the norms a tuple leaves out None, its window 0 (a full layer)."""
    return [(*layer, None, None, None, None, 0)[:11] for layer in layers]


class LayerStack:
    """A Llama/Qwen decoder's layers in one kernel call per forward (``kernels/layers.cpp``
    ``ld_decoder_layers``): for each layer the calls ``Block.forward`` makes on the kernels' route
    (RMSNorm, the packed projections, Qwen3's per-head norms of q and k, rope and cache store, the
    attention kernel, the residual adds, SiLU times up), with the same bits, without the ~130 us of
    Python and torch dispatch per layer around them.  ``layers``: per layer ``(wqkv, wo, w_gate_up,
    w_down, attn_norm, mlp_norm[, q_norm, k_norm[, post_attn_norm, post_mlp_norm, window]])`` with ``QLinear``
    projections (bf16 outputs) and bf16 norm weights (left out or None where the model has none; Gemma 3's
    norms after the attention and the MLP; ``window`` true for a sliding-window layer, which takes ``run``'s
    ``local`` rope tables and slots); ``scale``: the attention's (None: 1/sqrt(head_dim)); ``plus_one``: every
    norm Gemma's x * (1 + w); ``activation``: "silu" or "gelu_tanh"; ``softcap``: the attention scores' cap
    (Gemma 2).  ``of`` returns None where a layer does not fit."""

    def __init__(self, layers: list[tuple], hidden: int, inter: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, eps: float, scale: float | None = None, plus_one: bool = False,
                 activation: str = "silu", softcap: float | None = None) -> None:
        table = gelu_tanh_table() if activation == "gelu_tanh" else silu_table()
        self._keep: list = [table]
        arr = (LdLayer * len(layers))()
        self.windowed = False
        for i, (wqkv, wo, gate_up, down, *norms, window) in enumerate(_with_qk_norms(layers)):
            self._keep += [wqkv, wo, gate_up, down, *norms]  # alive while their addresses are used
            arr[i] = LdLayer(_ld_linear(wqkv, self._keep), _ld_linear(wo, self._keep),
                             _ld_linear(gate_up, self._keep), _ld_linear(down, self._keep),
                             *(None if w is None else w.data_ptr() for w in norms), int(bool(window)))
            self.windowed = self.windowed or bool(window)
        self.layers = arr
        self.n_layers = len(layers)
        self.shape = dict(hidden=hidden, inter=inter, hq=n_heads, hkv=n_kv_heads, d=head_dim, eps=eps,
                          scale=1.0 / math.sqrt(head_dim) if scale is None else scale, silu=table.data_ptr(),
                          plus_one=int(plus_one), softcap=float(softcap or 0.0))
        self.work = max(kernel_library.library().ld_work_bytes(lin.in_features, p.group)
                        for lin in {id(m): m for layer in layers for m in layer[:4]}.values() for p in lin.parts)
        probe = LdStack(**self.shape)
        self._scratch_per_row = max(kernel_library.library().ld_layers_scratch(ctypes.byref(probe),
                                                                                ctypes.byref(arr[i]), 1)
                                    for i in range(len(layers)))

    @classmethod
    def of(cls, layers: list[tuple], **shape) -> "LayerStack | None":
        """The stack, or None where a layer does not fit (a projection that is not a ``QLinear``
        with bf16 outputs, norm weights that are not contiguous bf16 CPU tensors, a hidden size
        that is not a multiple of 16: the op-by-op route then normalizes in torch) or the kernel
        is not available."""
        # (ld_rmsnorm_bf16 takes rows of 16k values)
        if kernel_library.kernel_problem() is not None or shape["hidden"] % 16:
            return None
        if shape.get("activation", "silu") not in ("silu", "gelu_tanh"):
            return None
        for wqkv, wo, gate_up, down, attn_norm, mlp_norm, q_norm, k_norm, post_attn, post_mlp, _ in _with_qk_norms(layers):
            if not all(type(m) is QLinear and not m.out_fp32 for m in (wqkv, wo, gate_up, down)):
                return None
            if (q_norm is None) != (k_norm is None) or q_norm is not None and shape["head_dim"] % 16:
                return None
            if not all(w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
                       for w in (attn_norm, mlp_norm, q_norm, k_norm, post_attn, post_mlp) if w is not None):
                return None
        return cls(layers, **shape)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            slot0: int, flat: torch.Tensor, offsets: torch.Tensor, which: list[int] | range,
            local: tuple | None = None) -> torch.Tensor:
        """Layers ``which`` over ``x`` (contiguous bf16 ``[1, T, hidden]``, T <= 64) with a cache
        whose keys and values are ``k``/``v`` (``[layers, 1, kv_heads, slots, head_dim]`` bf16),
        the new tokens at slots ``slot0..``, row t attending over ``flat[offsets[t]:offsets[t + 1]]``.
        ``local``: the sliding-window layers' ``(cos, sin, flat, offsets)`` (needed where a layer is windowed).
        Returns ``[len(which), T, hidden]``: the residual stream after each layer run."""
        if (k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or k.stride(-1) != 1 or v.stride(-1) != 1
                or x.shape[1] > MAX_ROWS):
            raise ValueError("LayerStack.run: unexpected shapes, dtypes or layers")
        stack = LdStack(**self.shape, k=k.data_ptr(), k_layer=k.stride(0), k_head=k.stride(2), k_slot=k.stride(3),
                        v=v.data_ptr(), v_layer=v.stride(0), v_head=v.stride(2), v_slot=v.stride(3))
        if local is not None:
            lcos, lsin, lflat, loffsets = local
            t = x.shape[1]
            if (lcos.shape != cos.shape or lsin.shape != cos.shape or lcos.dtype != torch.bfloat16
                    or lsin.dtype != torch.bfloat16 or not lcos.is_contiguous() or not lsin.is_contiguous()
                    or lflat.dtype != torch.int64 or loffsets.dtype != torch.int64 or loffsets.numel() != t + 1):
                raise ValueError("LayerStack.run: unexpected shapes, dtypes or layers")
            stack.local_cos, stack.local_sin = lcos.data_ptr(), lsin.data_ptr()
            stack.local_idx, stack.local_offsets = lflat.data_ptr(), loffsets.data_ptr()
        elif self.windowed:
            raise ValueError("LayerStack.run: windowed layers need the local rope tables and slots")
        return self._call(stack, x, cos, sin, slot0, flat, offsets, which)

    def run_segments(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_start: torch.Tensor,
                     kv_base: torch.Tensor, kv_step: torch.Tensor, flat: torch.Tensor, offsets: torch.Tensor,
                     which: list[int] | range) -> torch.Tensor:
        """The same over the rows of several sequences side by side (``x``: ``[1, N, hidden]``,
        any N), rows ``seg_start[s]:seg_start[s + 1]`` being sequence s's, rotated, stored and
        attended on its own cache as ``rope_attend_segments`` does (layer l's table
        ``kv_base + l * kv_step``, int64 ``[S, 7]``: ``native.FusedSegments``): each row gets the
        bits of its own sequence's forward."""
        nseg = seg_start.numel() - 1
        if (seg_start.dtype != torch.int64 or kv_base.dtype != torch.int64 or kv_step.dtype != torch.int64
                or not kv_base.is_contiguous() or not kv_step.is_contiguous() or kv_base.shape != (nseg, 7)
                or kv_step.shape != (nseg, 7) or nseg < 1):
            raise ValueError("LayerStack.run_segments: unexpected shapes, dtypes or layers")
        stack = LdStack(**self.shape, nseg=nseg, seg_start=seg_start.data_ptr(), seg_kv=kv_base.data_ptr(),
                        seg_kv_step=kv_step.data_ptr())
        return self._call(stack, x, cos, sin, 0, flat, offsets, which)

    def _call(self, stack: LdStack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot0: int,
              flat: torch.Tensor, offsets: torch.Tensor, which: list[int] | range) -> torch.Tensor:
        t = x.shape[1]
        which = list(which)
        n = len(which)
        if (x.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape != (1, t, self.shape["hidden"])
                or cos.shape != (t, self.shape["d"]) or sin.shape != cos.shape or not cos.is_contiguous()
                or not sin.is_contiguous() or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16
                or flat.dtype != torch.int64 or offsets.dtype != torch.int64 or offsets.numel() != t + 1
                or any(not 0 <= i < self.n_layers for i in which)):
            raise ValueError("LayerStack.run: unexpected shapes, dtypes or layers")
        xs = torch.empty(n, t, self.shape["hidden"], dtype=torch.bfloat16)
        room = self._scratch_per_row * t
        scratch = torch.empty(room, dtype=torch.bfloat16)
        which_t = torch.tensor(which, dtype=torch.int64)
        rc = kernel_library.library().ld_decoder_layers(ctypes.byref(stack), self.layers, which_t.data_ptr(), n,
                                                        x.data_ptr(), xs.data_ptr(), t, cos.data_ptr(), sin.data_ptr(),
                                                        slot0, flat.data_ptr(), offsets.data_ptr(), scratch.data_ptr(),
                                                        room, _work_buffer(self.work).data_ptr(),
                                                        torch.get_num_threads())
        if rc:
            raise RuntimeError(f"ld_decoder_layers failed ({rc})")
        return xs
