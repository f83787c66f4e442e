"""The mixture-of-experts feed-forward of the native decoder (issue 63): a router and ``n_experts``
SwiGLU experts in place of a layer's MLP, of which each token runs its top ``experts_per_token``.

The architectures: Mixtral (Mixtral of Experts, Jiang et al., 2024: 8 experts, the top 2, a softmax
over all experts renormalized over the two), Qwen3-MoE (Qwen3 Technical Report, Qwen Team, 2025: 128
experts, the top 8, renormalized with ``norm_topk_prob``) and OLMoE (OLMoE: Open Mixture-of-Experts
Language Models, Muennighoff et al., 2024: 64 experts, the top 8, not renormalized).  The routing is
transformers' (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``OlmoeTopKRouter``): router logits in
the activations' dtype, softmax in fp32, ``torch.topk``, the optional renormalization, and each expert's
output times its weight (Mixtral: the fp32 weight; the others: the weight in the activations' dtype).

Exact is the contract: a row's output depends on that row alone.  Its router logits come from a
one-row product of their own (a matrix product over many rows may round differently from one over a
single row), softmax and top-k are per row, each expert is a ``QLinear`` on the kernels (whose rows do
not depend on the other rows of a call) applied to the rows routed to it, and a row's experts' outputs
are added in the order of the experts' ids (as transformers' loop with ``index_add_`` adds them), the
same order whatever else is in the forward.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .qkernel import silu_mul


class SparseMoe(nn.Module):
    """A layer's experts and router (``forward``: the normalized hidden rows in, the feed-forward's output
    out).  ``gate_up[e]``: expert ``e``'s gate and up projections stacked (``[2 * ff, hidden]``), ``down[e]``
    its down projection; ``router``: ``[n_experts, hidden]``, kept in float."""

    def __init__(self, hidden: int, inter: int, n_experts: int, top_k: int, norm_topk_prob: bool,
                 weights_fp32: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.weights_fp32 = top_k, norm_topk_prob, weights_fp32
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.gate_up = nn.ModuleList(nn.Linear(hidden, 2 * inter, bias=False) for _ in range(n_experts))
        self.down = nn.ModuleList(nn.Linear(inter, hidden, bias=False) for _ in range(n_experts))

    @classmethod
    def of(cls, cfg) -> "SparseMoe":
        """For a ``ModelConfig`` with experts."""
        return cls(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_experts, cfg.experts_per_token,
                   cfg.norm_topk_prob, cfg.moe_weights_fp32)

    def router_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[N, n_experts]`` for the rows ``h`` (``[N, hidden]``): one product per row, each on a freshly
        allocated copy of its row, so a row's logits are the same bits alone as among others."""
        w = self.router.weight
        if h.shape[0] == 0:
            return h.new_zeros(0, w.shape[0], dtype=w.dtype)
        return torch.cat([F.linear(row.to(w.dtype).clone(), w) for row in h.split(1)])

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's experts' weights ``[N, k]``, their ids ``[N, k]``), as transformers' routers give them."""
        logits = self.router_logits(h)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_fp32 else weights.to(logits.dtype)), ids

    def forward(self, h: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        """The experts' weighted sum for each row of ``h`` (``[..., hidden]``); ``rowwise``: ask layers with a
        row-wise mode (``QLinear.rowwise``) to use it, as ``Block.forward_rows`` does."""
        shape = h.shape
        h2 = h.reshape(-1, shape[-1])
        weights, ids = self.route(h2)
        out = torch.zeros_like(h2)
        for e in torch.unique(ids).tolist():  # ascending: each row's experts added in the order of their ids
            rows, rank = torch.where(ids == e)
            y = self.expert(e, h2[rows], rowwise)
            out.index_add_(0, rows, (y * weights[rows, rank, None]).to(out.dtype))
        return out.reshape(shape)

    def expert(self, e: int, x: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        """Expert ``e``'s SwiGLU on the rows ``x`` (``[n, hidden]``): SiLU and product in one kernel call where
        it runs (torch's bits), as ``Block.mlp`` computes them."""
        gate, up = _call(self.gate_up[e], x, rowwise).chunk(2, dim=-1)
        act = None
        if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
            act = silu_mul(gate, up)
        if act is None:
            act = F.silu(gate) * up
        return _call(self.down[e], act, rowwise)

    def linears(self) -> list[tuple[str, nn.Module]]:
        """The experts' projections by their names under this module (``gate_up.E``, ``down.E``)."""
        return [(f"{kind}.{e}", m) for kind in ("gate_up", "down") for e, m in enumerate(getattr(self, kind))]

    def replace_linears(self, make: Callable[[str, nn.Module], nn.Module]) -> None:
        """Each expert's projection ``name`` (as ``linears`` names it) replaced by ``make(name, layer)``: what
        quantizing a model does to them; the router stays as it is."""
        for name, layer in self.linears():
            kind, e = name.split(".")
            getattr(self, kind)[int(e)] = make(name, layer)


def _call(layer: nn.Module, x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    fn = getattr(layer, "rowwise", None) if rowwise else None
    return fn(x) if fn is not None else layer(x)


# the names checkpoints give a layer's router and experts (after ``model.layers.N.``): transformers v5's
# fused 3-D parameters, a GGUF's stacked ones (``gguf_tensors``), and the per-expert modules on disk
ROUTER_NAMES = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
PER_EXPERT = {  # (gate, up, down) of expert E
    "mlp.experts": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                    "mlp.experts.{e}.down_proj.weight"),
    "block_sparse_moe.experts": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                                 "block_sparse_moe.experts.{e}.w2.weight"),  # Mixtral's
}


def expert_state(cfg, layer_prefix: str, state: dict[str, torch.Tensor],
                 get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts from a Hugging Face-format state dict, under ``SparseMoe``'s
    names (``router.weight``, ``gate_up.E.weight``, ``down.E.weight``); ``get`` takes a weight out of
    ``state``.  ``KeyError`` naming the router or expert weight missing."""
    p = layer_prefix
    router = next((p + n for n in ROUTER_NAMES if p + n in state), p + ROUTER_NAMES[0])
    own = {"router.weight": get(router)}
    n = cfg.n_experts
    if p + "mlp.experts.gate_up_proj" in state:  # transformers v5: [E, 2 ff, hidden] and [E, hidden, ff]
        gate_up, down = get(p + "mlp.experts.gate_up_proj"), get(p + "mlp.experts.down_proj")
        pairs = [(gate_up[e], down[e]) for e in range(n)]
    elif p + "mlp.experts.gate_proj.weight" in state:  # a GGUF's: gate, up [E, ff, hidden], down [E, hidden, ff]
        gate, up, down = (get(p + f"mlp.experts.{k}_proj.weight") for k in ("gate", "up", "down"))
        pairs = [(torch.cat([gate[e], up[e]]), down[e]) for e in range(n)]
    else:
        names = next((v for v in PER_EXPERT.values() if p + v[0].format(e=0) in state), PER_EXPERT["mlp.experts"])
        pairs = [(torch.cat([get(p + names[0].format(e=e)), get(p + names[1].format(e=e))]),
                  get(p + names[2].format(e=e))) for e in range(n)]
    for e, (gate_up, down) in enumerate(pairs):
        own[f"gate_up.{e}.weight"], own[f"down.{e}.weight"] = gate_up, down
    return own
