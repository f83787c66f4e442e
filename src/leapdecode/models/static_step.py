"""The static decoding step: the target's small forwards at a few fixed shapes, replayed from CUDA
graphs on a GPU.

At batch 1 a GPU forward of a 1.5B decoder is ~28 layers x ~15 kernels launched one by one from
Python: the launches and the host's dispatch, not the GPU, set its time.  A CUDA graph
(``torch.cuda.CUDAGraph``) records a forward's kernels once and replays them with one launch, but it
replays fixed shapes at fixed addresses.  So, as vLLM and SGLang do for their decoding batches, a
forward of up to 64 new tokens (a decoding step, a token tree to verify, a short prompt chunk) is
padded to a fixed shape of ``rows`` query rows over ``span`` cache slots.  Two shape policies
(``NativeCausalLM.static_shapes``):

* ``"exact"`` (the default): every forward has **one shape**: ``EXACT_ROWS`` (16) rows over the
  whole cache (``span`` = the cache's length); a longer tree runs as consecutive forwards of 16
  rows, the later ones attending to the earlier ones' keys like any pending tree node.  Every
  matrix product and attention call then has the same shape and the same kernel whatever the
  tree, so a token's logits have the same bits in a verification forward as in a plain decoding
  step, and speculative decoding gives vanilla's tokens (measured on an H200: identical where
  mixed shapes were not; docs/results.md).  A decoding step pays for 16 rows (on the H200 1.23x
  one row) and attention over the whole slot.
* ``"buckets"``: rows padded to the next of ``ROW_BUCKETS`` (1, 2, 4, ..., 64) and the span to
  the next power of two of at least ``MIN_SPAN`` slots: the cheapest step for each forward, but
  the GPU's GEMM library picks its kernel (split-K or not) by shape, so a token's logits may
  differ between buckets in the last bits: not exact, off by default.

One graph per (rows, span, hidden states wanted, logits wanted), captured on first use over one
cache's storage, so the graphs of a cache live with the cache (``KVCache.static``: a runner's
slot, reused across generations, keeps its graphs).  What changes between replays is copied into
the graph's input buffers first: the tokens, their positions, the cache slots their keys and
values go to, and a ``[rows, span]`` mask of the slots each row attends to (the committed
sequence and the row's own tree ancestors, as ``KVCache.plan_append`` registers them).  A padded
row is token 0 at position 0, written to a free slot past the forward's own (never attended by a
real row, overwritten by a later forward), attending to slot 0 only: it never changes a real
row's inputs.

The graph's body is ``padded_forward``: the same decoder layers as ``NativeCausalLM.forward``
(``Block``'s projections, rope, MLP and norms), with the keys and values stored by
``index_copy_`` and attention as one masked SDPA call per layer over the span, the query heads
that share a key head stacked as that head's rows (no ``enable_gqa``, so the fused kernels take
the mask).  On the CPU it runs without capture (``NativeCausalLM.static_steps = "padded"``):
that is how the padding is tested where no GPU is (tests/test_static_step.py: with
batch-invariant linear layers, padded rows, a longer span and a tree cut into 16-row forwards
change no real row's logits bit).  ``scripts/gpu_check.py`` measures both policies on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
EXACT_ROWS = 16
MIN_SPAN = 256
MAX_ROWS = 64  # the longest forward that takes the static step (longer ones: prefill chunks, eager)
STATIC_MODES = ("auto", "off", "padded", "graphs")
SHAPE_POLICIES = ("exact", "buckets")


def row_bucket(t: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int | None:
    """The smallest bucket that holds ``t`` rows (None: more rows than the largest bucket)."""
    return next((b for b in sorted(buckets) if b >= t), None)


def span_bucket(total: int, max_len: int) -> int:
    """Cache slots attention reads for a forward that leaves ``total`` slots in use: the next power
    of two of at least ``MIN_SPAN`` that holds them, at most the cache's length."""
    span = MIN_SPAN
    while span < total:
        span *= 2
    return min(span, max_len)


def plan_chunks(t: int, shapes: str) -> list[tuple[int, int, int]]:
    """How a forward of ``t`` tokens runs: ``(start, stop, rows)`` per padded forward, under the
    shape policy ``shapes`` (see the module docstring); empty: it does not take the static step."""
    if shapes not in SHAPE_POLICIES:
        raise ValueError(f"unknown static_shapes {shapes!r}; use one of {', '.join(SHAPE_POLICIES)}")
    if not 0 < t <= MAX_ROWS:
        return []
    if shapes == "exact":
        return [(a, min(a + EXACT_ROWS, t), EXACT_ROWS) for a in range(0, t, EXACT_ROWS)]
    return [(0, t, row_bucket(t))]


def span_of(shapes: str, total: int, max_len: int) -> int:
    """The cache slots a padded forward reads: the whole cache (``"exact"``), or ``span_bucket``."""
    return max_len if shapes == "exact" else span_bucket(total, max_len)


def resolve_mode(mode: str, device: torch.device) -> str:
    """``"auto"``: CUDA graphs on a CUDA device, off elsewhere."""
    if mode not in STATIC_MODES:
        raise ValueError(f"unknown static_steps {mode!r}; use one of {', '.join(STATIC_MODES)}")
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "off"
    return mode


@dataclass
class StepInputs:
    """One padded forward's inputs: ``tokens``, ``positions`` and ``slots`` (``[rows]`` long) and
    ``mask`` (``[rows, span]`` bool, True: may attend)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def empty(cls, rows: int, span: int, device: torch.device) -> "StepInputs":
        z = torch.zeros(rows, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.clone(), torch.zeros(rows, span, dtype=torch.bool, device=device))

    def fill(self, other: "StepInputs") -> None:
        for mine, theirs in ((self.tokens, other.tokens), (self.positions, other.positions),
                             (self.slots, other.slots), (self.mask, other.mask)):
            mine.copy_(theirs, non_blocking=True)


def pad_inputs(cache, tokens: torch.Tensor, positions: torch.Tensor, rows: int, span: int) -> StepInputs:
    """The padded inputs of a forward whose ``T = len(tokens)`` nodes ``cache.plan_append`` has just
    registered (at ``positions``): real rows first, then ``rows - T`` padded ones (see the module
    docstring).  Needs ``cache.total + rows - T <= cache.max_len``."""
    t = tokens.numel()
    device = cache.device
    total, length = cache.total, cache.length
    pad = rows - t
    if total + pad > cache.max_len or total > span:
        raise ValueError(f"{rows} rows over {span} slots do not fit a cache of {cache.max_len} with {total} in use")
    slots = torch.arange(total - t, total + pad, device=device)
    tok = torch.zeros(rows, dtype=torch.long, device=device)
    tok[:t] = tokens.reshape(-1)
    pos = torch.zeros(rows, dtype=torch.long, device=device)
    pos[:t] = positions
    mask = torch.zeros(rows, span, dtype=torch.bool, device=device)
    mask[:t, :length] = True
    mask[:t, length:total] = cache.ancestors(t)  # the new nodes' ancestors-or-self among the pending ones
    mask[t:, 0] = True
    return StepInputs(tok, pos, slots, mask)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``q`` ``[1, H, R, D]`` over ``keys``/``values`` ``[1, KV, S, D]`` with ``mask`` ``[1, 1, G * R,
    S]`` (``grouped_mask``): the ``G = H / KV`` query heads of a key head go in as that head's rows
    (one SDPA call, no ``enable_gqa``); returns ``[1, R, H * D]``."""
    _, h, r, d = q.shape
    kv = keys.shape[1]
    rows = q.reshape(1, kv, (h // kv) * r, d)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask)
    return out.reshape(1, h, r, d).transpose(1, 2).reshape(1, r, h * d)


def grouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """The ``[R, S]`` mask repeated for the ``groups`` query heads of a key head: ``[1, 1, G * R, S]``."""
    return mask.repeat(groups, 1)[None, None]


def padded_forward(model, cache, ins: StepInputs, states: bool, logits: bool):
    """The decoder over one padded forward (see the module docstring): writes the rows' keys and
    values to ``ins.slots`` and returns ``(logits [R, vocab] fp32 or None, hidden states
    [layers + 1, R, hidden] or None)``: pure tensor operations of fixed shapes, so that a CUDA
    graph can record them.  ``model``: a ``NativeCausalLM`` (its ``norm_rows`` is the decoder's
    RMSNorm)."""
    rms_norm = model.norm_rows
    cfg = model.cfg
    span = ins.mask.shape[1]
    x = model.embed(ins.tokens)[None]
    cos = model.rope_cos[ins.positions].to(model.dtype)
    sin = model.rope_sin[ins.positions].to(model.dtype)
    kept = [x] if states else None
    mask = grouped_mask(ins.mask, cfg.n_heads // cfg.n_kv_heads)  # once for every layer
    for i, block in enumerate(model.layers):
        h = rms_norm(x, block.attn_norm, cfg.rms_norm_eps)
        q, k, v = block.rotary_qkv(block.normed_qk(block.wqkv(h)), cos, sin)
        cache.k[i].index_copy_(2, ins.slots, k)
        cache.v[i].index_copy_(2, ins.slots, v)
        attn = grouped_attention(q, cache.k[i, :, :, :span], cache.v[i, :, :, :span], mask)
        x = x + block.wo(attn)
        x = x + block.mlp(x, block.w_gate_up, block.w_down)
        if kept is not None:
            kept.append(x)
    out = None
    if logits:
        out = model.lm_head(rms_norm(x, model.norm, cfg.rms_norm_eps))[0].float()
    return out, (torch.cat(kept) if kept is not None else None)


class _Graph:
    """One captured shape: its input buffers, the graph and its output tensors."""

    def __init__(self, model, cache, ins: StepInputs, states: bool, logits: bool, pool) -> None:
        self.ins = StepInputs.empty(ins.tokens.numel(), ins.mask.shape[1], ins.tokens.device)
        self.ins.fill(ins)
        # warm up on a side stream (lazy initialisations must not happen inside the capture); the
        # warm-up writes the same keys and values the first replay writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            padded_forward(model, cache, self.ins, states, logits)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = padded_forward(model, cache, self.ins, states, logits)

    def run(self, ins: StepInputs):
        self.ins.fill(ins)
        self.graph.replay()
        return self.out


class StaticSteps:
    """A cache's static steps: ``run`` pads a forward to its shape and runs it, from a CUDA graph
    captured on the shape's first use (``capture``), or as plain operations (no capture: the CPU,
    tests).  Counters: ``runs`` (forwards), ``captures`` (graphs recorded)."""

    def __init__(self, cache, capture: bool) -> None:
        self.cache = cache
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.runs = 0
        self.captures = 0
        self._owner: tuple = ()  # the weights the graphs read (``run``'s ``owner``), held

    def run(self, model, owner: tuple, ins: StepInputs, states: bool, logits: bool):
        """``owner``: identifies the decoder and its weights (``NativeCausalLM.weights_signature``);
        another one (weights replaced, another decoder on this storage) drops the graphs."""
        self.runs += 1
        if not self.capture:
            return padded_forward(model, self.cache, ins, states, logits)
        if len(owner) != len(self._owner) or any(a is not b for a, b in zip(owner, self._owner)):
            self.graphs.clear()
            self._owner = owner
        key = (ins.tokens.numel(), ins.mask.shape[1], states, logits)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Graph(model, self.cache, ins, states, logits, self.pool)
            self.captures += 1
        return graph.run(ins)
