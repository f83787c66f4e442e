"""Native PyTorch decoder for the Llama / Qwen / Phi-3 / Gemma family (SmolLM2, Llama 2/3, Mistral, Qwen2.5,
Qwen3, Phi-3/3.5/4-mini, Gemma 2/3, and the mixtures of experts Qwen3-MoE, Mixtral and OLMoE, whose experts
are models/moe.py; docs/models.md).

In the spirit of gpt-fast: one file, plain modules, a static KV cache
(``kv_cache.KVCache``).  Differences that matter for speed on CPU: the q/k/v
projections and the gate/up projections are fused into one matrix each, so a
decode step runs 4 matrix products per layer instead of 7.

``forward(tokens, cache, parents)`` appends the tokens to the cache as pending
tree nodes (see ``KVCache.plan_append``): every token attends to the committed
sequence plus its ancestors, at position ``committed length + depth``.  This is
the single entry point for prefill, plain decoding and tree verification.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .architecture import ModelConfig, qkv_row_order, rope_tables
from .kv_cache import CACHE_KINDS, KVCache
from .linear import PackedLinear, can_pack
from .moe import SparseMoe, expert_state
from .kernel_library import kernel_problem
from .kernel_prefill import DENSE_MIN_ROWS
from .qkernel import (LayerStack, QLinear, attend_rows, attention_supported, gelu_tanh_table, rms_norm_bf16,
                      rope_attend_segments, rope_store, silu_mul)
from .static_step import StaticSteps, pad_inputs, plan_chunks, resolve_mode, span_of

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    # computed in fp32 and cast back, as the HF Llama/Qwen2 RMSNorm does; bf16 rows on the CPU
    # in one kernel call (the same roundings, its own fixed summation order) instead of 9 ops.
    # ``plus_one``: Gemma's, x * rsqrt(...) * (1 + w) all in fp32, then cast (Gemma3RMSNorm)
    if x.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        y = rms_norm_bf16(x, weight, eps, plus_one)
        if y is not None:
            return y
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, sparse: bool = False) -> None:
        """``sparse``: the layer's MLP is a mixture of experts (``moe.SparseMoe``, ``self.moe``; ``w_gate_up``
        and ``w_down`` are then None)."""
        super().__init__()
        self.cfg = cfg
        q_out = cfg.n_heads * cfg.head_dim
        kv_out = cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        self.wo = nn.Linear(q_out, cfg.hidden_size, bias=False)
        self.moe = SparseMoe.of(cfg) if sparse else None
        self.w_gate_up = None if sparse else nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = None if sparse else nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        # OLMoE's norms span the whole q and k projections, Qwen3's one head
        q_width, k_width = (q_out, kv_out) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = nn.Parameter(torch.ones(q_width)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(k_width)) if cfg.qk_norm else None
        # Gemma 3: the attention's and the MLP's outputs normalized before their residual adds
        self.post_attn_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.sandwich_norms else None
        self.post_mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.sandwich_norms else None

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm (``rms_norm``; Gemma's ``1 + w`` where the configuration says so)."""
        return rms_norm(x, weight, self.cfg.rms_norm_eps, self.cfg.norm_plus_one)

    def post_attention(self, a: torch.Tensor) -> torch.Tensor:
        """The attention's output projected as the residual adds it (Gemma 3: normalized first)."""
        return a if self.post_attn_norm is None else self.norm(a, self.post_attn_norm)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        mask: torch.Tensor | None,
        rows: "QueryRows | None" = None,
    ) -> torch.Tensor:
        """``rows`` (batch-invariant attention, ``NativeCausalLM.attention == "invariant"``): for
        each new token, the cache slots it attends to (``KVCache.attended_slots``); attention is
        then computed one query at a time over those keys gathered into contiguous tensors, and
        ``mask`` is ignored."""
        h = self.norm(x, self.attn_norm)
        x = x + self.post_attention(self.wo(self.attend(self.normed_qk(self.wqkv(h)), cos, sin, cache, layer, mask,
                                                        rows)))
        if self.moe is not None:
            return x + self.moe(self.norm(x, self.mlp_norm))
        return x + self.mlp(x, self.w_gate_up, self.w_down)

    def forward_rows(self, x: torch.Tensor, segments: list["Segment"], layer: int, cos: torch.Tensor,
                     sin: torch.Tensor, fused: "FusedSegments | None" = None) -> torch.Tensor:
        """One layer over the tokens of several sequences side by side (``x``: ``[1, N, hidden]``,
        the segments' tokens in order): the linear layers see all N rows at once, attention runs per
        segment on its own cache, exactly as ``forward`` would for that segment alone.  Linear
        layers are called row-wise (``rowwise_linear``): with the batch-invariant kernels each
        token's output then has the same bits as in its own sequence's forward.  ``fused``: every
        segment takes the kernels' route (``FusedSegments``): rope, cache stores and attention of
        all segments in one kernel call, with the bits of each segment's own ``attend``."""
        h = self.norm(x, self.attn_norm)
        qkv = self.normed_qk(rowwise_linear(self.wqkv, h))
        if fused is not None:
            attn = fused.attend(qkv, cos, sin, layer, self.cfg)
        else:
            # projections and rope for all rows at once (elementwise per row: the same bits as per
            # sequence), then cache writes and attention per sequence
            q, k, v = self.rotary_qkv(qkv, cos, sin)
            attn = torch.cat([self.attention(q[:, :, s.start : s.stop], k[:, :, s.start : s.stop],
                                             v[:, :, s.start : s.stop], s.cache, layer, s.mask, s.rows)
                              for s in segments], dim=1)
        x = x + self.post_attention(rowwise_linear(self.wo, attn))
        if self.moe is not None:
            return x + self.moe(self.norm(x, self.mlp_norm), rowwise=True)
        return x + self.mlp(x, lambda t: rowwise_linear(self.w_gate_up, t), lambda t: rowwise_linear(self.w_down, t))

    def normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """The q/k/v projections as attention takes them (``[B, T, q+2kv]``): with Qwen3's ``q_norm``
        and ``k_norm``, each head of q and of k RMS-normalized (``rms_norm``: the bf16 kernel's bits
        where it runs, as ``LayerStack`` computes them), v as it is; else ``qkv`` itself.  OLMoE: q and k
        each normalized over its whole projection (``qk_norm_whole``), then q, k and v clamped to
        ``[-clip_qkv, clip_qkv]`` where the configuration says so."""
        cfg = self.cfg
        if self.q_norm is None and cfg.clip_qkv is None:
            return qkv
        b, t, _ = qkv.shape
        q, k, v = qkv.split((cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim), -1)
        if self.q_norm is not None and cfg.qk_norm_whole:
            q, k = self.norm(q.contiguous(), self.q_norm), self.norm(k.contiguous(), self.k_norm)
        elif self.q_norm is not None:
            q = self.norm(q.reshape(b, t, cfg.n_heads, cfg.head_dim), self.q_norm)
            k = self.norm(k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), self.k_norm)
        if cfg.clip_qkv is not None:
            c = cfg.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v), dim=-1)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
               mask: torch.Tensor | None, rows: "QueryRows | None") -> torch.Tensor:
        """Attention of one sequence's new tokens (``qkv``: ``[B, T, q+2kv]``) over its cache;
        returns ``[B, T, heads * head_dim]``, ready for the output projection."""
        if kernel_route(cache, rows) and qkv.shape[0] == 1 and qkv.is_contiguous():
            # the kernels' route: rope and the cache store in one call, then the attention kernel
            # (the same values as rotary_qkv + KVCache.write + attention: tests/test_attention_kernel.py)
            cfg = self.cfg
            end = cache.total
            keys, values = cache.layer_kv(layer, end)
            t = qkv.shape[1]
            if attention_supported(qkv, keys, cfg.n_heads):
                q = rope_store(qkv, cos, sin, cfg.n_heads, cfg.n_kv_heads, keys, values, end - t)
                return attend_rows(q, keys, values, rows.flat, rows.offsets, cfg.attn_scale,
                                   cfg.attn_softcap).view(1, t, -1)
        return self.attention(*self.rotary_qkv(qkv, cos, sin), cache, layer, mask, rows)

    def rotary_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys and values (``[B, heads, T, head_dim]``) with rope applied."""
        cfg = self.cfg
        b, t, _ = qkv.shape
        q_out = cfg.n_heads * cfg.head_dim
        kv_out = cfg.n_kv_heads * cfg.head_dim
        q, k, v = qkv.split((q_out, kv_out, kv_out), dim=-1)
        q = q.view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                  mask: torch.Tensor | None, rows: "QueryRows | None") -> torch.Tensor:
        """Write ``k``/``v`` to the cache and attend; ``[B, T, heads * head_dim]``."""
        cfg = self.cfg
        b, _, t, _ = q.shape
        q_out = cfg.n_heads * cfg.head_dim
        keys, values = cache.write(layer, k, v)
        if cache.observer is not None:  # a KV-cache policy reads the queries (core/kv_policy.py)
            cache.observer(layer, q, keys)
        if rows is not None and rows.kernel and attention_supported(q, keys):
            # leapdecode's kernel (models/kernels/attention.cpp): each token over exactly its
            # visible slots in cache order, read in place, with the same operations whatever
            # the other tokens of the forward
            return attend_rows(q, keys, values, rows.flat, rows.offsets, cfg.attn_scale, cfg.attn_softcap).view(b, t, q_out)
        if rows is not None:
            # one query per call, over exactly its visible keys in cache order: the same call on
            # the same inputs whether the token comes alone or in a tree.  Keys that are slots
            # 0..n-1 (a token alone, a chain's nodes) are read in place; a branch's are gathered
            # (the same bits: tests/test_invariant_attention.py)
            out = []
            for i, idx in enumerate(rows.slots):
                n = idx.numel()
                if int(idx[-1]) == n - 1:  # the slots ascend from 0: contiguous
                    k_i, v_i = keys[:, :, :n], values[:, :, :n]
                else:
                    k_i, v_i = keys.index_select(2, idx), values.index_select(2, idx)
                out.append(self.one_query(q[:, :, i : i + 1], k_i, v_i))
            attn = torch.cat(out, dim=2)
        else:
            attn = self.sdpa(q, keys, values, mask)
        return attn.transpose(1, 2).reshape(b, t, q_out)

    def one_query(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of one token's query heads (``[B, heads, 1, D]``) over ``keys``/``values``
        (``[B, kv_heads, n, D]``): the query heads that share a key head go in as that head's rows
        of one call (no mask: they all see the same keys), which on the CPU is ~13x cheaper than
        SDPA's ``enable_gqa`` for a single query (``scripts/attention_call_speed.py``; figures in
        docs/lab-notes/benchmarks.md section 15)."""
        b, heads, _, d = q.shape
        kv = keys.shape[1]
        if heads == kv:
            return self.sdpa(q.contiguous(), keys, values, None)
        grouped = q.reshape(b, kv, heads // kv, d)
        return self.sdpa(grouped, keys, values, None).reshape(b, heads, 1, d)

    def sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention with the model's scale; with Gemma 2's soft cap, as transformers'
        eager attention computes it (scores, their cap, the mask, softmax in fp32), which SDPA cannot."""
        cfg = self.cfg
        cap = cfg.attn_softcap
        if not cap:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=cfg.attn_scale,
                                                  enable_gqa=q.shape[1] != keys.shape[1])
        rep = q.shape[1] // keys.shape[1]
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * (cfg.attn_scale or q.shape[-1] ** -0.5)
        scores = torch.tanh(scores / cap) * cap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)

    def mlp(self, x: torch.Tensor, gate_up, down) -> torch.Tensor:
        """The MLP's output as the residual adds it (Gemma 3: GELU-tanh, and normalized last)."""
        h = self.norm(x, self.mlp_norm)
        gate, up = gate_up(h).chunk(2, dim=-1)
        gelu = self.cfg.activation == "gelu_tanh"
        act = None
        if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
            # one kernel call, torch's bits (LayerStack computes it so too)
            act = silu_mul(gate, up, gelu_tanh_table() if gelu else None)
        if act is None:
            act = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
        out = down(act)
        return out if self.post_mlp_norm is None else self.norm(out, self.post_mlp_norm)


def rowwise_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, asking a layer that has a row-wise mode (``QLinear.rowwise``: the
    batch-invariant kernel at any row count, never the bf16 prefill copy) to use it."""
    rowwise = getattr(layer, "rowwise", None)
    return rowwise(x) if rowwise is not None else layer(x)


@dataclass
class QueryRows:
    """The invariant attention's plan for the new tokens of one forward: per token, the cache
    slots it attends to (``KVCache.attended_slots``), and the same lists flattened once for the
    attention kernel (``flat``; token ``t``'s slots are ``flat[offsets[t]:offsets[t + 1]]``).
    ``kernel``: use leapdecode's attention kernel where it takes the tensors (else one SDPA call
    per token)."""

    slots: list[torch.Tensor]
    flat: torch.Tensor
    offsets: torch.Tensor
    kernel: bool = True

    @classmethod
    def of(cls, slots: list[torch.Tensor], kernel: bool = True) -> "QueryRows":
        lengths = torch.tensor([0] + [s.numel() for s in slots], dtype=torch.long)
        flat = torch.cat(slots).to(device="cpu", dtype=torch.long) if kernel else slots[0].new_zeros(0)
        return cls(slots, flat, lengths.cumsum(0), kernel)


def kernel_route(cache: KVCache, rows: "QueryRows | None") -> bool:
    """Whether a sequence's attention can take the kernels' route (rope and cache store in
    ``ld_rope_store``, then ``ld_attend_rows``): the invariant attention with the kernel, on a plain
    ``KVCache`` that no KV policy observes."""
    return rows is not None and rows.kernel and type(cache) is KVCache and cache.observer is None


class FusedSegments:
    """What ``rope_attend_segments`` needs to run every segment of a batched forward in one call
    per layer: the segments' row ranges, their caches' addresses and strides (the layer's added
    per call), the first new slot of each, and all rows' attended slots with global offsets.
    Built once per ``forward_batch``; ``of`` returns None unless every segment takes the kernels'
    route of ``Block.attend`` (invariant attention with the kernel, a plain ``KVCache`` without an
    observer, tensors ``attention_supported`` takes)."""

    def __init__(self, seg_start: torch.Tensor, base: torch.Tensor, step: torch.Tensor, flat: torch.Tensor,
                 offsets: torch.Tensor) -> None:
        self.seg_start, self.base, self.step, self.flat, self.offsets = seg_start, base, step, flat, offsets

    @classmethod
    def of(cls, segments: list["Segment"], n_heads: int, dtype: torch.dtype) -> "FusedSegments | None":
        rows_of = []
        base, step = [], []
        for seg in segments:
            cache, rows = seg.cache, seg.rows
            if not kernel_route(cache, rows):
                return None
            k, v = cache.k, cache.v
            if k.dim() != 5 or k.shape[1] != 1 or k.dtype != dtype or v.dtype != dtype or k.stride(-1) != 1 \
                    or v.stride(-1) != 1 or not attention_supported(k, cache.layer_kv(0, cache.total)[0], n_heads):
                return None
            t = seg.stop - seg.start
            esize = k.element_size()
            base.append([k.data_ptr(), k.stride(2), k.stride(3), v.data_ptr(), v.stride(2), v.stride(3),
                         cache.total - t])
            step.append([k.stride(0) * esize, 0, 0, v.stride(0) * esize, 0, 0, 0])
            rows_of.append(rows)
        lengths = [r.offsets[1:] - r.offsets[:-1] for r in rows_of]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(lengths).cumsum(0)])
        seg_start = torch.tensor([0] + [s.stop - segments[0].start for s in segments], dtype=torch.long)
        return cls(seg_start, torch.tensor(base, dtype=torch.long), torch.tensor(step, dtype=torch.long),
                   torch.cat([r.flat for r in rows_of]), offsets)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cfg: "ModelConfig") -> torch.Tensor:
        kv = self.base + layer * self.step
        return rope_attend_segments(qkv, cos, sin, self.seg_start, kv, self.flat, self.offsets, cfg.n_heads,
                                    cfg.n_kv_heads)


@dataclass
class Segment:
    """One sequence's tokens inside a batched forward (``NativeCausalLM.forward_batch``): rows
    ``start:stop`` of the batch, with that sequence's cache and attention plan."""

    start: int
    stop: int
    cache: KVCache
    mask: torch.Tensor | None
    rows: QueryRows | None


@dataclass
class BatchItem:
    """One sequence's part of a batched forward: what ``NativeCausalLM.forward`` takes for it."""

    tokens: torch.Tensor  # [T]
    cache: KVCache
    parents: list[int] | None = None
    logits_for: slice | list[int] | None = None
    hidden_states: list | None = None


class NativeCausalLM(nn.Module):
    """Llama/Qwen2 decoder with a tree-aware static KV cache."""

    backend = "native"
    quantization: str | None = None  # "int8"/"int4" once models/quant.py has converted the linears
    # "sdpa": one masked scaled_dot_product_attention per layer (fast, but on CPU in bf16 a
    # token's attention output can differ by an ulp between a tree forward and a 1-token one).
    # "invariant": forwards of up to INVARIANT_MAX_TOKENS tokens attend one query at a time over
    # exactly its visible keys (see ``Block.forward``), so a token's logits do not depend on
    # what else is in the forward: tree verification then reproduces greedy decoding bitwise.
    # Longer forwards (prefill chunks) keep the masked call; every method prefills alike.
    attention: str = "sdpa"
    INVARIANT_MAX_TOKENS = 64
    # "invariant" on the CPU in fp32/bf16: leapdecode's attention kernel (models/kernels/
    # attention.cpp: every token over its slots read in place, all tokens in one call) instead of
    # one SDPA call per token and layer; False keeps the SDPA calls (both are invariant, with
    # different roundings).  Where the kernel cannot run (no compiler, CUDA) SDPA is used.
    attention_kernel: bool = True
    # On the kernels' route (invariant attention with the kernel, QLinear layers, a plain cache,
    # bf16, up to 64 tokens): all the decoder layers of a forward in one call of
    # kernels/layers.cpp (``LayerStack``), with the bits of the op-by-op route; False runs
    # ``Block.forward`` layer by layer.
    layers_kernel: bool = True
    _stack: tuple | None = None  # (signature of the layers' modules and weights, LayerStack or None)
    # Forwards of up to 64 tokens padded to a few fixed shapes (``models/static_step.py``):
    # "graphs" replays them from CUDA graphs, "padded" runs the padded forward without capture (the
    # CPU's test of the padding), "off" never; "auto": "graphs" on CUDA, else "off".
    static_steps: str = "auto"
    # "exact": one shape for every forward (16 rows over the whole cache: a token's logits the same
    # bits in any forward, so speculation is exact); "buckets": the cheapest padded shape per forward
    # (not guaranteed exact on a GPU).  See models/static_step.py.
    static_shapes: str = "exact"

    @property
    def cut_invariant_tokens(self) -> int:
        """The longest forward whose tokens' keys and values have the same bits however a prompt is
        cut into forwards: with quantized weights (the batch-invariant kernels: the int4 kernel up to
        ``DENSE_MIN_ROWS`` rows, torch's int8 kernel at any) and the invariant attention (up to
        ``INVARIANT_MAX_TOKENS`` tokens), that many; 0 otherwise (a prompt's chunks are then cut
        the same way wherever it runs: ``core/prefix_cache.py``)."""
        if not self.quantization or self.attention != "invariant":
            return 0
        return min(self.INVARIANT_MAX_TOKENS, DENSE_MIN_ROWS)

    @property
    def prefill_cut_invariant(self) -> bool:
        """Whether prompts are best prefilled in forwards of ``cut_invariant_tokens`` tokens: then
        every token's keys and values are a function of the tokens up to it alone, whatever the
        prompt's length and however it is cut, and a decoded token's are the bits a prefill would
        compute (the prefix cache reuses a chat's earlier turns: ``core/prefix_cache.py``).  True
        where the invariant attention runs on its kernel (CPU) and no block layer measured faster
        prefilling on its bf16 copy (``QLinear.prefills_on_dense``: e.g. AMX bf16 tiles), which
        only forwards of more than ``DENSE_MIN_ROWS`` rows may use.  Larger forwards would gain only
        SDPA's attention in place of the kernel's (docs/lab-notes/benchmarks.md section 38)."""
        if (self.cut_invariant_tokens == 0 or not self.attention_kernel or self.device.type != "cpu"
                or self.dtype not in (torch.bfloat16, torch.float32) or kernel_problem() is not None):
            return False
        linears = [m for b in self.layers for m in (b.wqkv, b.wo, b.w_gate_up, b.w_down) if isinstance(m, QLinear)]
        return bool(linears) and not any(m.prefills_on_dense() for m in linears)

    def __init__(self, cfg: ModelConfig, max_seq_len: int | None = None, attention: str = "sdpa") -> None:
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.exact_context or 1 << 62)
        # zeros, not nn.Embedding's random init: every caller assigns the weights, and normal_ on
        # the meta device (load_packed) imports torch._dynamo (as rope_tables says)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.zeros(cfg.vocab_size, cfg.hidden_size))
        sparse = cfg.sparse_layers or (False,) * cfg.n_layers
        self.layers = nn.ModuleList(Block(cfg, sparse[i]) for i in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg, self.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.local_rope_theta is not None:  # the windowed layers' own rope (Gemma 3)
            cos, sin = rope_tables(cfg, self.max_seq_len, local=True)
            self.register_buffer("rope_cos_local", cos, persistent=False)
            self.register_buffer("rope_sin_local", sin, persistent=False)

    def pack_for_cpu(self) -> "NativeCausalLM":
        """Swap every linear layer for a oneDNN-packed one (bf16 on CPU only; no-op otherwise)."""
        if not can_pack(self):
            return self
        for block in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                if getattr(block, name) is not None:  # (a sparse layer's experts stay plain layers)
                    setattr(block, name, PackedLinear(getattr(block, name)))
        self.replace_head(PackedLinear(self.lm_head))
        return self

    def replace_head(self, head: nn.Module, plain_weight: torch.Tensor | None = None) -> None:
        """Use ``head`` (a packed or quantized output projection) and keep the plain ``[vocab,
        hidden]`` weight for ``head_weight`` (default: the current head's, or, for a head that can
        ``dequantize()`` itself, its weights dequantized on first use; a tied head's is the
        embedding's anyway)."""
        if not self.cfg.tie_word_embeddings:
            if plain_weight is None and hasattr(head, "dequantize"):
                self._head_weight = None  # see head_weight
            else:
                self._head_weight = (plain_weight if plain_weight is not None else self.head_weight).detach()
        self.lm_head = head

    @property
    def head_weight(self) -> torch.Tensor:
        """The output projection's plain ``[vocab, hidden]`` weight (also after packing), from
        which a proposer can build a smaller head over a subset of the vocabulary."""
        if self.cfg.tie_word_embeddings:
            return self.embed.weight
        packed_away = getattr(self, "_head_weight", None)
        if packed_away is None and hasattr(self.lm_head, "dequantize"):
            # a block-quantized head (models/blockquant.py): its weights, dequantized once on demand
            packed_away = self._head_weight = self.lm_head.dequantize().to(self.dtype)
        return packed_away if packed_away is not None else self.lm_head.weight

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    def new_cache(self, batch_size: int = 1, max_len: int | None = None, kind: str = "plain") -> KVCache:
        """An empty cache; ``kind``: ``"plain"`` (the model's dtype) or ``"int8"``
        (``kv_cache.Int8KVCache``, lossy: for an ``int8`` KV-cache policy)."""
        if kind not in CACHE_KINDS:
            raise ValueError(f"unknown KV cache kind {kind!r}; use one of {', '.join(CACHE_KINDS)}")
        return CACHE_KINDS[kind](
            self.cfg.n_layers,
            self.cfg.n_kv_heads,
            self.cfg.head_dim,
            min(max_len or self.max_seq_len, self.max_seq_len),
            batch_size=batch_size,
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        parents: list[int] | None = None,
        logits_for: slice | list[int] | None = None,
        layers: list[int] | None = None,
        hidden_states: list | None = None,
        head: nn.Module | None = None,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` ([B, T]) as pending nodes and return fp32 logits.

        ``logits_for`` selects which of the T positions get logits (all by
        default; ``slice(-1, None)`` for a prefill).  ``layers`` runs only those
        decoder layers (self-speculation by layer skipping); skipped layers
        leave their cache slots unwritten, so such a forward must be rolled back
        before a full forward reuses the slots.

        ``hidden_states`` (a list) receives the
        residual stream ``[B, T, hidden]`` after the embedding and after each layer
        that runs (references to tensors the forward makes anyway: no copies).

        ``head`` replaces the output projection (e.g. a drafter's head over a subset of
        the vocabulary); the logits are then over that head's outputs.

        ``embeds`` ([B, T, hidden]) is fed instead of ``embed(tokens)`` (``tokens`` then only
        gives the shape): superposed decoding's weighted sums of token embeddings.
        """
        if tokens.dim() == 1:
            tokens = tokens[None]
        if layers is None and head is None and embeds is None:
            out = self._static_forward(tokens, cache, parents, logits_for, hidden_states)
            if out is not None:
                return out
        t = tokens.shape[1]
        (cos, sin, mask, rows), local = self._plan(cache, parents, t)
        x = self.embed(tokens) if embeds is None else embeds.to(self.dtype).reshape(*tokens.shape, -1)
        x = self.scaled_embeds(x)
        hidden = hidden_states
        if hidden is not None:
            hidden.append(x)
        which = layers if layers is not None else range(self.cfg.n_layers)
        stack = self._layer_stack(x, cache, rows) if len(which) else None
        if stack is not None:
            windowed = None if local is None else (local[0], local[1], local[3].flat, local[3].offsets)
            xs = stack.run(x, cos, sin, cache.k, cache.v, cache.total - t, rows.flat, rows.offsets, which, windowed)
            x = xs[-1:]
            if hidden is not None:
                hidden.extend(xs[j : j + 1] for j in range(xs.shape[0]))
        else:
            windows = self.cfg.layer_windows
            for i in which:
                if windows is not None and windows[i]:  # a sliding-window layer: its slots and rope
                    x = self.layers[i](x, *local[:2], cache, i, *local[2:])
                else:
                    x = self.layers[i](x, cos, sin, cache, i, mask, rows)
                if hidden is not None:
                    hidden.append(x)
        if logits_for is not None:
            x = x[:, logits_for]
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps, self.cfg.norm_plus_one)
        logits = (head or self.lm_head)(x).float()
        cap = self.cfg.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def scaled_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the first layer takes them: Gemma's times ``sqrt(hidden)`` (an fp32 scalar
        rounded to the activations' dtype, then one rounded product, as transformers computes it)."""
        if not self.cfg.embed_scale:
            return x
        return x * torch.tensor(self.cfg.hidden_size ** 0.5).to(x.dtype)

    def _static_forward(self, tokens: torch.Tensor, cache: KVCache, parents: list[int] | None,
                        logits_for: slice | list[int] | None, hidden: list | None) -> torch.Tensor | None:
        """``forward`` through the cache's static steps (``static_steps``, ``static_shapes``), or None
        where this forward does not take them (mode off, more than 64 tokens, a batched or policy
        cache, no room for the padded rows)."""
        mode = resolve_mode(self.static_steps, self.device)
        t = tokens.shape[1]
        chunks = plan_chunks(t, self.static_shapes)
        if (mode == "off" or not chunks or tokens.shape[0] != 1 or type(cache) is not KVCache or not self.cfg.plain_layers
                or cache.observer is not None or cache.k.shape[1] != 1
                or cache.total + chunks[-1][0] + chunks[-1][2] > cache.max_len):
            return None
        steps = cache.static
        if steps is None or steps.capture != (mode == "graphs"):
            steps = cache.static = StaticSteps(cache, capture=mode == "graphs")
        picked = torch.arange(t)[logits_for if logits_for is not None else slice(None)]
        # what the captured graphs read: only graphs need it (a ~170-entry tuple per forward)
        owner, several = self.weights_signature() if steps.capture else (), len(chunks) > 1
        logits, states = [], []
        for a, b, rows in chunks:
            positions, _ = cache.plan_append(None if parents is None else parents[a:b], b - a)
            ins = pad_inputs(cache, tokens[:, a:b], positions, rows,
                             span_of(self.static_shapes, cache.total, cache.max_len))
            lg, st = steps.run(self, owner, ins, hidden is not None, picked.numel() > 0)
            # the graph's outputs are overwritten by its next replay: copies when a forward runs several
            if lg is not None:
                logits.append(lg[: b - a].clone() if several else lg[: b - a])
            if st is not None:
                states.append(st[:, : b - a].clone() if several else st[:, : b - a])
        if hidden is not None:
            st = torch.cat(states, 1) if several else states[0]
            hidden.extend(st[j : j + 1].clone() for j in range(st.shape[0]))
        if not logits:
            return torch.zeros(1, 0, self.vocab_size, device=self.device)
        lg = torch.cat(logits) if several else logits[0]
        if logits_for is None:  # every row: a copy (a graph's output is overwritten by its next replay)
            return (lg if several else lg.clone())[None]
        return lg[picked.to(lg.device)][None]

    norm_rows = staticmethod(rms_norm)  # the decoder's RMSNorm, for the static step's body

    def embedding_sample(self, step: int) -> torch.Tensor:
        """Every ``step``-th value of the flattened embedding table (a table kept in the GGUF's blocks
        dequantizes only the rows this touches)."""
        strided = getattr(self.embed, "strided", None)
        return strided(step) if strided is not None else self.embed.weight.detach().reshape(-1)[::step]

    def weights_signature(self) -> tuple:
        """The decoder's modules and weights (compared by identity): what a captured forward reads."""
        return (self.embed, self.lm_head, self.norm, *self._layer_parts())

    def _layer_parts(self):
        """Every decoder layer's modules and parameters, in order (what a layer's computation reads)."""
        return (m for b in self.layers for m in (*b._modules.values(), *b._parameters.values()))

    def _layer_stack(self, x: torch.Tensor, cache: KVCache, rows: "QueryRows | None") -> LayerStack | None:
        """The ``LayerStack`` of this model's layers where this forward of one sequence can take it
        (see ``layers_kernel``), else None."""
        if not (self.layers_kernel and kernel_route(cache, rows) and x.dtype == torch.bfloat16
                and x.shape[0] == 1
                and x.is_contiguous() and cache.k.dim() == 5 and cache.k.dtype == torch.bfloat16
                and cache.v.dtype == torch.bfloat16 and x.shape[1] <= self.INVARIANT_MAX_TOKENS
                and attention_supported(x, cache.k[0], self.cfg.n_heads)):
            return None
        return self._stack_of_layers()

    def _stack_of_layers(self) -> LayerStack | None:
        """The layers' ``LayerStack`` (None where a layer does not fit it): built on first use, and
        again when a layer's module or weight was replaced (checked by identity: the stack holds
        them, so no id is reused)."""
        signature = tuple(id(m) for m in self._layer_parts())
        if self._stack is None or self._stack[0] != signature:
            cfg = self.cfg
            if cfg.op_by_op:  # experts, OLMoE's q/k norms: not what kernels/layers.cpp computes
                self._stack = (signature, None)
                return None
            windows = cfg.layer_windows or (0,) * cfg.n_layers
            layers = [(b.wqkv, b.wo, b.w_gate_up, b.w_down, b.attn_norm, b.mlp_norm, b.q_norm, b.k_norm,
                       b.post_attn_norm, b.post_mlp_norm, windows[i]) for i, b in enumerate(self.layers)]
            stack = LayerStack.of(layers, hidden=cfg.hidden_size, inter=cfg.intermediate_size, n_heads=cfg.n_heads,
                                  n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                                  scale=cfg.attn_scale, plus_one=cfg.norm_plus_one, activation=cfg.activation,
                                  softcap=cfg.attn_softcap)
            self._stack = (signature, stack)
        return self._stack[1]

    def _apply(self, fn, recurse=True):
        self._stack = None  # the weights may move (``to()``, ``share_memory()``): built again on next use
        return super()._apply(fn, recurse)

    def _plan(self, cache: KVCache, parents: list[int] | None, t: int):
        """Register ``t`` new pending nodes in ``cache``; their rope tables and attention plan
        ``(cos, sin, mask, rows)``, and the same for the sliding-window layers (None: the model has none)."""
        if self.attention not in ("sdpa", "invariant"):
            raise ValueError(f"unknown attention {self.attention!r}; use 'sdpa' or 'invariant'")
        positions, mask = cache.plan_append(parents, t)
        rows = None
        invariant = self.attention == "invariant" and t <= self.INVARIANT_MAX_TOKENS
        if invariant:
            rows, mask = QueryRows.of(cache.attended_slots(t), self.attention_kernel), None
        elif mask is None and t > 1:
            # causal chain after `past` slots: token i sees slots <= past + i
            total = cache.total
            past = total - t
            mask = torch.ones(t, total, dtype=torch.bool, device=cache.device).tril(past)
        cos = self.rope_cos[positions].to(self.dtype)
        sin = self.rope_sin[positions].to(self.dtype)
        local = None
        if self.cfg.layer_windows is not None:  # Gemma 3's windowed layers: the last `window` positions
            window = max(self.cfg.layer_windows)
            if invariant:
                local_rows, local_mask = QueryRows.of(cache.attended_slots(t, window), self.attention_kernel), None
            else:
                if cache.pos_offset:
                    raise ValueError("a sliding window needs a cache whose slots are the positions (no KV-cache policy)")
                seen = cache.slot_positions()[None, :] > positions[:, None] - window
                local_rows, local_mask = None, seen if mask is None else mask & seen
            if self.cfg.local_rope_theta is None:  # every layer's own rope (Mistral v0.1, Phi-3)
                local = (cos, sin, local_mask, local_rows)
            else:
                local = (self.rope_cos_local[positions].to(self.dtype), self.rope_sin_local[positions].to(self.dtype),
                         local_mask, local_rows)
        return (cos, sin, mask, rows), local

    @torch.inference_mode()
    def forward_batch(self, items: list[BatchItem]) -> list[torch.Tensor]:
        """Forwards of several sequences (each on its own cache) in one pass; returns each item's
        fp32 logits (``[1, len(logits_for), vocab]``), as ``forward`` would for it alone.

        Items of at most ``INVARIANT_MAX_TOKENS`` tokens (decoding steps, token trees, short prefill
        chunks) go through the linear layers together, their rows side by side
        (``Block.forward_rows``); attention stays per sequence, each over its own cache (with the
        invariant attention kernel: all sequences' rope, cache stores and attention in one kernel
        call per layer, ``FusedSegments``).  With the batch-invariant kernels
        and attention (the default quantized formats) every token then gets the same bits as in
        its own forward: a request's output does not depend on what else is in the batch.  With
        other kernels (bf16/fp32 oneDNN linears) it may differ in the last bits, as a tree's rows
        do.  Longer items (prefill chunks) run as their own ``forward`` (the prefill kernels)."""
        out: list[torch.Tensor | None] = [None] * len(items)
        # (a model with other layers than Llama's, Gemma 3's: each item its own forward, the same bits)
        small = [i for i, it in enumerate(items)
                 if it.tokens.numel() <= self.INVARIANT_MAX_TOKENS and self.cfg.plain_layers]
        for i, it in enumerate(items):
            if i not in small or len(small) == 1:
                out[i] = self.forward(it.tokens.view(1, -1), it.cache, parents=it.parents, logits_for=it.logits_for,
                                      hidden_states=it.hidden_states)
        if len(small) < 2:
            return out
        segments, coss, sins, start = [], [], [], 0
        for i in small:
            it = items[i]
            t = it.tokens.numel()
            (cos, sin, mask, rows), _ = self._plan(it.cache, it.parents, t)
            segments.append(Segment(start, start + t, it.cache, mask, rows))
            coss.append(cos)
            sins.append(sin)
            start += t
        x = self.embed(torch.cat([items[i].tokens.view(-1) for i in small])[None])
        cos, sin = torch.cat(coss), torch.cat(sins)
        wanted = [items[i].hidden_states is not None for i in small]
        states = [x] if any(wanted) else None
        fused = FusedSegments.of(segments, self.cfg.n_heads, self.dtype) if x.device.type == "cpu" else None
        stack = None
        if fused is not None and self.layers_kernel and x.dtype == torch.bfloat16:
            stack = self._stack_of_layers()  # every layer in one call, each row with forward_rows's bits
        if stack is not None:
            xs = stack.run_segments(x, cos, sin, fused.seg_start, fused.base, fused.step, fused.flat, fused.offsets,
                                    range(self.cfg.n_layers))
            x = xs[-1:]
            if states is not None:
                states.extend(xs[j : j + 1] for j in range(xs.shape[0]))
        else:
            for layer in range(self.cfg.n_layers):
                x = self.layers[layer].forward_rows(x, segments, layer, cos, sin, fused)
                if states is not None:
                    states.append(x)
        picked, counts = [], []
        for seg, i in zip(segments, small):
            sel = items[i].logits_for
            rows = torch.arange(seg.start, seg.stop, device=x.device)
            rows = rows if sel is None else rows[sel]
            picked.append(rows)
            counts.append(rows.numel())
        x = rms_norm(x[:, torch.cat(picked)], self.norm, self.cfg.rms_norm_eps, self.cfg.norm_plus_one)
        logits = rowwise_linear(self.lm_head, x).float() if x.shape[1] else x.new_zeros(1, 0, self.vocab_size).float()
        for (seg, i, want), part in zip(zip(segments, small, wanted), logits.split(counts, dim=1)):
            out[i] = part
            if want:
                items[i].hidden_states.extend(s[:, seg.start : seg.stop] for s in states)
        return out

    # ------------------------------------------------------------- loading
    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_seq_len: int | None = None,
    ) -> "NativeCausalLM":
        """Build from a Hugging Face-format (Llama/Qwen2 naming) state dict, emptied as it is read:
        each weight is dropped from ``state`` as it is taken, so that a large model is not held
        twice while its q/k/v and gate/up weights are joined."""
        with torch.device("meta"):
            model = cls(cfg, max_seq_len=max_seq_len)
        get = state.pop
        own: dict[str, torch.Tensor] = {"embed.weight": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
        if not cfg.tie_word_embeddings:
            own["lm_head.weight"] = get("lm_head.weight")
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            if cfg.fused_projections:  # Phi-3: already fused, in this decoder's order
                own[f"layers.{i}.wqkv.weight"] = get(a + "qkv_proj.weight")
            else:
                own[f"layers.{i}.wqkv.weight"] = torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                                            get(a + "v_proj.weight")])
            if cfg.attention_bias:
                own[f"layers.{i}.wqkv.bias"] = torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
            order = qkv_row_order(cfg)  # a partial rotary embedding: the heads' dims as the kernels' rope takes them
            if order is not None:
                for key in (f"layers.{i}.wqkv.weight", f"layers.{i}.wqkv.bias"):
                    if key in own:
                        own[key] = own[key][order]
            own[f"layers.{i}.wo.weight"] = get(a + "o_proj.weight")
            if model.layers[i].moe is not None:  # a router and experts (models/moe.py)
                own.update((f"layers.{i}.moe.{k}", v) for k, v in expert_state(cfg, p, state, get).items())
            else:
                own[f"layers.{i}.w_gate_up.weight"] = (
                    get(p + "mlp.gate_up_proj.weight") if cfg.fused_projections else
                    torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
                own[f"layers.{i}.w_down.weight"] = get(p + "mlp.down_proj.weight")
            own[f"layers.{i}.attn_norm"] = get(p + "input_layernorm.weight")
            if cfg.sandwich_norms:  # Gemma 3: its post_attention_layernorm follows the attention
                own[f"layers.{i}.mlp_norm"] = get(p + "pre_feedforward_layernorm.weight")
                own[f"layers.{i}.post_attn_norm"] = get(p + "post_attention_layernorm.weight")
                own[f"layers.{i}.post_mlp_norm"] = get(p + "post_feedforward_layernorm.weight")
            else:
                own[f"layers.{i}.mlp_norm"] = get(p + "post_attention_layernorm.weight")
            if cfg.qk_norm:
                own[f"layers.{i}.q_norm"] = get(a + "q_norm.weight")
                own[f"layers.{i}.k_norm"] = get(a + "k_norm.weight")
        own = {k: v.to(device=device, dtype=dtype) for k, v in own.items()}
        model.load_state_dict(own, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        return model.materialized(device)

    def materialized(self, device: str | torch.device = "cpu") -> "NativeCausalLM":
        """Finish a model built on the meta device whose weights were assigned: the rope tables
        on ``device``, eval mode; a ``ValueError`` names weights still missing."""
        cos, sin = rope_tables(self.cfg, self.max_seq_len)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        if self.cfg.local_rope_theta is not None:
            cos, sin = rope_tables(self.cfg, self.max_seq_len, local=True)
            self.rope_cos_local, self.rope_sin_local = cos.to(device), sin.to(device)
        missing = [n for n, p in self.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}")
        return self.eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_seq_len: int | None = None,
    ) -> "NativeCausalLM":
        from safetensors.torch import load_file

        path = Path(path)
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {path}")
        for f in files:
            state.update(load_file(str(f)))
        return cls.from_state_dict(cfg, state, dtype=dtype, device=device, max_seq_len=max_seq_len)
