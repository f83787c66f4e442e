"""Weight-only int8 / int4 linear layers on torch's batch-invariant weight-only kernels.

``Int8Linear``: per-output-channel symmetric int8 weights, ``y = x @ (q * scale).T``, on
``aten._weight_int8pack_mm``.  ``Int4Linear``: asymmetric int4 in groups of 32 (64, 128, 256)
input columns, ``w = (q - 8) * scale + zero`` with ``q`` in 0..15, on
``aten._weight_int4pack_mm_for_cpu`` (CPU) or ``aten._weight_int4pack_mm`` (CUDA).

Why: a decode step reads every weight once, so int8 / int4 weights read 2x / ~3.5x fewer
bytes than bf16; and both CPU kernels compute every output row with the same instruction
sequence whatever the number of rows M (per-row fp32 accumulators over K, blocks of 4 rows
that never mix), so a token's logits do not depend on how many tokens share its forward.
bf16 ``F.linear`` (oneDNN) changes its blocking with M and is not batch invariant.

The kernels' layouts, as measured on torch 2.13 (``tests/test_quant.py`` checks them):

* int8: ``_weight_int8pack_mm(x[M, K] bf16, w[N, K] int8, scales[N] bf16) -> [M, N] bf16``,
  ``y = x @ (w * scales[:, None]).T``.  The CPU kernel reads 16 columns at a time with
  *aligned* loads: ``K % 16 == 0`` and a 32-byte aligned ``x`` are required (it segfaults
  otherwise, no error), so ``Int8Linear`` checks K at build time and copies a misaligned ``x``.
* int4 (CPU): ``_convert_weight_to_int4pack_for_cpu(q[N, K] int32 in 0..15, inner_k_tiles)``
  gives a ``[N, K/2]`` uint8 tensor in a CPU-specific tiled layout (``inner_k_tiles`` is
  ignored); ``_weight_int4pack_mm_for_cpu(x[M, K] bf16, packed, group, sz)`` with
  ``sz[K/group, N, 2]`` in bf16, ``sz[..., 0]`` the scale and ``sz[..., 1]`` the zero of a
  group: ``w = (q - 8) * scale + zero`` (dequantized in fp32 by an FMA).  Needs ``N % 16 == 0``,
  ``K % group == 0``, group in 32/64/128/256.
* int4 (CUDA, from gpt-fast/torchao usage; not run here): ``_convert_weight_to_int4pack(
  packed[N, K/2] uint8 (even column in the high nibble), inner_k_tiles)`` and
  ``_weight_int4pack_mm(x, packed4d, group, sz)`` with the same ``sz``; ``N % 8 == 0`` and
  ``K % (16 * inner_k_tiles) == 0``.

Scales and zeros are stored in bf16, the kernels' activation dtype: a layer's quantization
picks codes against the bf16-rounded scale and zero, so the codes are the best ones for the
parameters the kernel actually uses.

A layer whose shape a kernel cannot take stays a float layer (``quantize_model`` records the
reason in ``model.quant_fallbacks`` and warns) rather than failing.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from .linear import PackedLinear, can_pack
from .native import NativeCausalLM

WEIGHT_FORMATS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
BLOCK_LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
ACT_DTYPE = torch.bfloat16  # the kernels' activation (and scale) dtype


def _as_kernel_input(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as a contiguous, 64-byte aligned ``[rows, k]`` bf16 matrix (copied only if needed:
    the CPU int8 kernel uses aligned vector loads and crashes on a misaligned pointer)."""
    x2 = x.reshape(-1, k)
    if x2.dtype != ACT_DTYPE:
        x2 = x2.to(ACT_DTYPE)
    if not x2.is_contiguous() or x2.data_ptr() % 64:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    return x2


class Int8Linear(nn.Module):
    """A linear layer with per-output-channel symmetric int8 weights: ``w = q * scale[n]``."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D int8 tensor, not {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        reason = self.unsupported(self.out_features, self.in_features, qweight.device)
        if reason is not None:
            raise ValueError(f"Int8Linear: {reason}")
        if scales.shape != (self.out_features,):
            raise ValueError(f"scales must be [{self.out_features}], not {tuple(scales.shape)}")
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(ACT_DTYPE).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(ACT_DTYPE).contiguous())

    @staticmethod
    def unsupported(out_features: int, in_features: int, device: torch.device | str = "cpu") -> str | None:
        """Why the int8 kernel cannot take a ``[out_features, in_features]`` weight on ``device``
        (None: it can)."""
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return f"no int8 weight-only kernel on {device.type}"
        if in_features % 16:
            return f"in_features {in_features} is not a multiple of 16 (the kernel reads 16 columns at a time)"
        return None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Quantize a float ``[out, in]`` weight: ``scale = max|w_row| / 127`` (rounded to bf16),
        ``q = round(w / scale)`` clamped to -127..127."""
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(ACT_DTYPE)
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    def dequantize(self) -> torch.Tensor:
        """The ``[out, in]`` fp32 weight the kernel multiplies by (exact: ``q * scale``)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(_as_kernel_input(x, self.in_features), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _inner_k_tiles(in_features: int) -> int:
    """CUDA tinygemm's K tiling: the largest of 8, 4, 2 with ``in_features % (16 * tiles) == 0``."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    return 0


class Int4Linear(nn.Module):
    """A linear layer with asymmetric group-wise int4 weights: for column ``k`` of group
    ``g = k // group_size``, ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``, ``q`` in 0..15."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 in_features: int, out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().to(ACT_DTYPE).contiguous())

    @staticmethod
    def unsupported(out_features: int, in_features: int, group_size: int = 32,
                    device: torch.device | str = "cpu") -> str | None:
        """Why the int4 kernel cannot take a ``[out_features, in_features]`` weight in groups of
        ``group_size`` on ``device`` (None: it can)."""
        device = torch.device(device)
        if group_size not in INT4_GROUP_SIZES:
            return f"group size {group_size} is not one of {', '.join(map(str, INT4_GROUP_SIZES))}"
        if in_features % group_size:
            return f"in_features {in_features} is not a multiple of the group size {group_size}"
        if device.type == "cpu":
            if out_features % 16:
                return f"out_features {out_features} is not a multiple of 16 (the CPU kernel's column blocks)"
        elif device.type == "cuda":
            if out_features % 8:
                return f"out_features {out_features} is not a multiple of 8 (the CUDA kernel's tiles)"
            if not _inner_k_tiles(in_features):
                return f"in_features {in_features} is not a multiple of 32 (the CUDA kernel's K tiles)"
        else:
            return f"no int4 weight-only kernel on {device.type}"
        return None

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None) -> "Int4Linear":
        """From codes ``q[N, K]`` (0..15) and per-group ``scales[N, K/g]``, ``zeros[N, K/g]`` in the
        kernel's form ``w = (q - 8) * scale + zero`` (the group size is ``K / scales.shape[1]``).

        E.g. a GGUF Q4_K sub-block ``w = d*sc*q - dmin*m`` is ``scale = d*sc``,
        ``zero = 8*scale - dmin*m``; Q4_0 ``w = d*(q - 8)`` is ``scale = d``, ``zero = 0``; Q4_1
        ``w = d*q + m`` is ``scale = d``, ``zero = 8*d + m``.  Scales and zeros are rounded to
        bf16 (the kernel's parameter dtype)."""
        if codes.dim() != 2 or scales.dim() != 2 or scales.shape != zeros.shape:
            raise ValueError(f"codes [N, K] and scales, zeros [N, K/group]; got {tuple(codes.shape)}, "
                             f"{tuple(scales.shape)}, {tuple(zeros.shape)}")
        n, k = codes.shape
        if scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
            raise ValueError(f"scales {tuple(scales.shape)} do not split codes {tuple(codes.shape)} into groups")
        group_size = k // scales.shape[1]
        reason = cls.unsupported(n, k, group_size, codes.device)
        if reason is not None:
            raise ValueError(f"Int4Linear: {reason}")
        q = codes.to(torch.int32)
        if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
            raise ValueError("int4 codes must lie in 0..15")
        # [K/g, N, 2]: scale and zero of group g, output n
        sz = torch.stack([scales.t(), zeros.t()], dim=-1).to(device=codes.device, dtype=ACT_DTYPE).contiguous()
        if codes.device.type == "cuda":
            pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(k))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
        return cls(packed, sz, group_size, k, n, bias)

    @staticmethod
    def quantize(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Min/max asymmetric quantization in groups of ``group_size`` columns: ``(codes[N, K] uint8,
        scales[N, K/g], zeros[N, K/g])`` in the kernel's form, scales and zeros bf16-rounded."""
        n, k = weight.shape
        if group_size <= 0 or k % group_size:
            raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
        w = weight.detach().float().reshape(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12).to(ACT_DTYPE).float()
        zero = (lo + 8.0 * scale).to(ACT_DTYPE).float()
        # the codes against the parameters the kernel will use (bf16-rounded)
        q = torch.round((w - zero[..., None]) / scale[..., None] + 8.0).clamp_(0, 15)
        return q.to(torch.uint8).reshape(n, k), scale, zero

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int = 32) -> "Int4Linear":
        """Quantize a float ``[out, in]`` weight (``quantize``) and pack it for the kernel."""
        n, k = weight.shape
        reason = cls.unsupported(n, k, group_size, weight.device)
        if reason is not None:
            raise ValueError(f"Int4Linear: {reason}")
        codes, scales, zeros = cls.quantize(weight, group_size)
        return cls.from_codes(codes, scales, zeros, bias)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)

    @torch.no_grad()
    def dequantize(self, chunk: int = 256) -> torch.Tensor:
        """The ``[out, in]`` weight as the kernel sees it, read back through the kernel on the
        identity matrix (the packed layout is kernel-specific), so each entry is the fp32
        dequantized weight rounded to bf16.  Costs ``in_features`` rows of matmul: for tests and
        small layers."""
        k = self.in_features
        eye = torch.eye(k, dtype=ACT_DTYPE, device=self.packed.device)
        cols = [self._mm(eye[i:i + chunk].contiguous()) for i in range(0, k, chunk)]
        return torch.cat(cols).t().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._mm(_as_kernel_input(x, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


@functools.lru_cache(maxsize=None)
def _probe(weights: str, device_type: str, device_index: int | None) -> str | None:
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        w = torch.randn(64, 64, device=device)
        layer = Int8Linear.from_float(w) if weights == "int8" else Int4Linear.from_float(w, group_size=32)
        y = layer(torch.randn(2, 64, device=device, dtype=ACT_DTYPE))
        if y.shape != (2, 64) or not bool(torch.isfinite(y).all()):
            return "the kernel returned a wrong result"
    except (RuntimeError, ValueError, NotImplementedError, AttributeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def kernel_problem(weights: str, device: torch.device | str) -> str | None:
    """Why ``weights`` ("int8"/"int4") cannot run on ``device`` here (None: it can), from a probe
    of the kernel on a small layer, once per process and device."""
    if weights not in WEIGHT_FORMATS:
        return f"unknown weight format {weights!r}"
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return f"no {weights} weight-only kernel on {device.type} (cpu or cuda only)"
    return _probe(weights, device.type, device.index)


def to_activation_dtype(model: nn.Module) -> None:
    """Every floating-point parameter still in another dtype to bf16, the weight-only kernels'
    activation dtype (in place)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != ACT_DTYPE:
            p.data = p.data.to(ACT_DTYPE)


def quantize_model(model: NativeCausalLM, weights: str, group_size: int = 32) -> NativeCausalLM:
    """Replace ``wqkv``, ``wo``, ``w_gate_up``, ``w_down`` of every block with ``Int8Linear`` or
    ``Int4Linear`` (groups of ``group_size``) and the output head with an ``Int8Linear`` (int4
    for the head costs too much accuracy for its share of the bytes); the rest (embedding,
    norms) becomes bf16, the kernels' activation dtype.  In place; returns ``model``.

    ``model.head_weight`` stays the plain float ``[vocab, hidden]`` weight (the tied embedding,
    or the untied head's weight kept aside in bf16).  A layer a kernel cannot take stays a
    bf16 layer (oneDNN-packed on CPU); ``model.quant_fallbacks`` maps its name to the reason.
    Call it on a model of plain ``nn.Linear`` layers (before ``pack_for_cpu``)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; use one of {', '.join(WEIGHT_FORMATS)}")
    if getattr(model, "quantization", None):
        raise ValueError(f"model is already quantized ({model.quantization})")
    device = model.device
    fallbacks: dict[str, str] = {}

    def convert(name: str, lin: nn.Module, fmt: str) -> nn.Module:
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{name} is a {type(lin).__name__}, not an nn.Linear: quantize before pack_for_cpu")
        n, k = lin.weight.shape
        if fmt == "int4":
            reason = Int4Linear.unsupported(n, k, group_size, device)
            if reason is None:
                return Int4Linear.from_float(lin.weight, lin.bias, group_size)
        else:
            reason = Int8Linear.unsupported(n, k, device)
            if reason is None:
                return Int8Linear.from_float(lin.weight, lin.bias)
        fallbacks[name] = reason
        return lin

    with torch.no_grad():
        for i, block in enumerate(model.layers):
            for name in BLOCK_LINEARS:
                if getattr(block, name) is not None:  # (a sparse layer's MLP: its experts, below)
                    setattr(block, name, convert(f"layers.{i}.{name}", getattr(block, name), weights))
            if getattr(block, "moe", None) is not None:  # each expert's projections; the router stays float
                block.moe.replace_linears(lambda name, lin: convert(f"layers.{i}.moe.{name}", lin, weights))
        head = model.lm_head
        plain = model.head_weight.detach().to(ACT_DTYPE)  # proposers' subset heads slice it
        model.replace_head(convert("lm_head", head, "int8"), plain)
        to_activation_dtype(model)  # the embedding, norms and fallback layers
        if fallbacks and can_pack(model):
            for name in fallbacks:
                parent, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent)  # (the model itself for the head: "")
                setattr(parent, attr, PackedLinear(getattr(parent, attr)))
    if fallbacks:
        warnings.warn(f"{weights}: {len(fallbacks)} layer(s) kept in bf16: "
                      + "; ".join(f"{k}: {v}" for k, v in list(fallbacks.items())[:3])
                      + (" ..." if len(fallbacks) > 3 else ""), stacklevel=2)
    model.quantization = weights
    model.quant_group_size = group_size if weights == "int4" else None
    model.quant_fallbacks = fallbacks
    return model
