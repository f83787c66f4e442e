"""What each architecture the native decoder runs is (issue 63): its configuration read from a Hugging Face
``config.json`` (``ModelConfig.from_hf``, which refuses by name what the decoder does not compute as the
model does), and its rotary embedding's tables (``rope_tables``; a partial one's dims as the kernels' rope
takes them: ``rotary_order``).  docs/models.md lists the architectures and their status."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# mixture-of-experts decoders (models/moe.py): a router and top-k experts in place of the MLP
MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"}
MOE_MODEL_TYPES = {"qwen3_moe", "mixtral", "olmoe"}
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"} | MOE_ARCHITECTURES
# Gemma 2 and 3: norms x * (1 + w), four per layer (after attention and after the MLP too), GELU-tanh, a
# scaled embedding, its own attention scale, windowed layers; Gemma 3 with q/k norms and the windowed
# layers' own rope, Gemma 2 with soft-capped attention scores and logits
GEMMA_ARCHITECTURES = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
FUSED_ARCHITECTURES = {"Phi3ForCausalLM"}  # q/k/v and gate/up stored fused, as this decoder runs them
# an RMSNorm over each head of q and of k before rope (OLMoE's: over the whole projection, ``qk_norm_whole``)
QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict | None = None
    qk_norm: bool = False  # Qwen3: q and k normalized per head (``Block.q_norm``, ``k_norm``) before rope
    # per-frequency divisors of the rope's frequencies, as a GGUF's ``rope_freqs`` tensor gives Llama 3.1's
    # scaling (llama.cpp's converter computes them from ``rope_scaling``; models/convert.py keeps them)
    rope_freq_factors: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0  # cos and sin scaled by it (LongRoPE's attention factor)
    # a partial rotary embedding (Phi-4-mini: 3/4 of a head): the dims rotated, None for all; see ``rotary_order``
    rotary_dim: int | None = None
    # the longest context the native decoder computes exactly as the model does (None: any): the original
    # length of LongRoPE's short factors
    exact_context: int | None = None
    fused_projections: bool = False  # Phi-3: checkpoints hold q/k/v and gate/up fused (qkv_proj, gate_up_proj)
    # Gemma 2 and 3 (``GEMMA_ARCHITECTURES``); the defaults are Llama's
    norm_plus_one: bool = False  # RMSNorm as x * rsqrt(...) * (1 + w) in fp32, rounded once
    sandwich_norms: bool = False  # a norm on the attention's and on the MLP's output before each residual add
    embed_scale: bool = False  # the embedding times sqrt(hidden), rounded to the activations' dtype
    activation: str = "silu"  # or "gelu_tanh"
    attn_scale: float | None = None  # the attention's scale (None: 1/sqrt(head_dim))
    layer_windows: tuple[int, ...] | None = None  # per layer, the window of a sliding layer, 0 for a full one
    local_rope_theta: float | None = None  # the rope base of the sliding layers (None: every layer's rope)
    attn_softcap: float | None = None  # Gemma 2: each attention score s becomes tanh(s / c) * c
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    # mixture of experts (models/moe.py): per layer, whether its MLP is the experts' (None: no layer's)
    sparse_layers: tuple[bool, ...] | None = None
    n_experts: int = 0
    experts_per_token: int = 0  # the top k a row's router picks
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # the k picked probabilities renormalized to sum to 1
    moe_weights_fp32: bool = False  # Mixtral: an expert's output times its fp32 weight (else in the activations' dtype)
    qk_norm_whole: bool = False  # OLMoE: q and k normalized over the whole projection, not per head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-c, c] after the norms
    extra: dict = field(default_factory=dict)

    @property
    def op_by_op(self) -> bool:
        """Layers the fused ``LayerStack`` (kernels/layers.cpp) does not compute: experts, OLMoE's whole-width
        q/k norms, clipped q/k/v.  Such a model runs its layers op by op (``Block.forward``)."""
        return self.sparse_layers is not None or self.qk_norm_whole or self.clip_qkv is not None

    @property
    def plain_layers(self) -> bool:
        """Every layer is Llama's (what the batched route of ``forward_batch`` and the static step compute)."""
        return not (self.norm_plus_one or self.sandwich_norms or self.embed_scale or self.activation != "silu"
                    or self.attn_scale is not None or self.layer_windows is not None or self.attn_softcap
                    or self.final_softcap or self.op_by_op)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """From a Hugging Face ``config.json``; ``NotImplementedError`` naming what the native decoder does
        not compute as the model does (an architecture, a rope scaling, windowed layers mixed with full ones)."""
        archs = cfg.get("architectures") or []
        if archs and not set(archs) & SUPPORTED_ARCHITECTURES:
            raise NotImplementedError(f"native backend does not implement {archs}")
        gemma = bool(set(archs) & GEMMA_ARCHITECTURES) or cfg.get("model_type") in ("gemma2", "gemma3_text")
        if gemma:
            return cls.from_gemma(cfg)
        # transformers v5 writes rope settings as `rope_parameters`, v4 as `rope_scaling` + `rope_theta`
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in ("default", "llama3", "longrope", "su", None):
            raise NotImplementedError(f"native backend does not implement rope_scaling {rope_scaling}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rotary = int(head_dim * float(cfg.get("partial_rotary_factor") or rope_scaling.get("partial_rotary_factor") or 1.0))
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise NotImplementedError(f"native backend does not implement a rotary embedding of {rotary} of {head_dim} dims")
        if cfg.get("mlp_bias"):
            raise NotImplementedError("native backend does not implement biases on the MLP's projections (mlp_bias)")
        if cfg.get("attention_bias") and cfg.get("model_type", "") != "qwen2":  # Qwen2's: q, k, v only, as computed
            raise NotImplementedError("native backend does not implement a bias on the attention's output projection "
                                      "(attention_bias)")
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
            raise NotImplementedError("native backend does not implement sliding-window attention")
        n_heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "")
        rope_theta = cfg.get("rope_theta") or rope_scaling.get("rope_theta", 10000.0)
        max_positions = cfg.get("max_position_embeddings", 4096)
        exact = None
        # every layer slides (Mistral v0.1, Phi-3-mini-4k): the windowed layers' attention on all of them
        windows = (int(window),) * cfg["num_hidden_layers"] if window and "use_sliding_window" not in cfg else None
        attention_factor = 1.0
        if kind in ("longrope", "su"):  # Phi-3's LongRoPE: its short factors, exact up to the original length
            original = int(rope_scaling.get("original_max_position_embeddings")
                           or cfg.get("original_max_position_embeddings") or max_positions)
            exact = original
            factor = rope_scaling.get("factor") or max_positions / original
            attention_factor = rope_scaling.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            max_position_embeddings=max_positions,
            rope_theta=float(rope_theta),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=rope_scaling if kind in ("llama3", "longrope", "su") else None,
            qk_norm=bool(set(archs) & QK_NORM_ARCHITECTURES) or model_type in ("qwen3", "qwen3_moe", "olmoe"),
            rope_freq_factors=tuple(cfg["rope_freq_factors"]) if cfg.get("rope_freq_factors") else None,
            rope_attention_factor=float(attention_factor),
            exact_context=exact,
            fused_projections=bool(set(archs) & FUSED_ARCHITECTURES) or model_type == "phi3",
            rotary_dim=rotary if rotary < head_dim else None,
            layer_windows=windows,
            **moe_settings(cfg, archs),
        )

    @classmethod
    def from_gemma(cls, cfg: dict) -> "ModelConfig":
        """Gemma 2's and Gemma 3's text decoders: their windowed and full layers, each kind with its rope
        (Gemma 3), and soft-capped attention scores and logits (Gemma 2)."""
        gemma2 = "Gemma2ForCausalLM" in (cfg.get("architectures") or []) or cfg.get("model_type") == "gemma2"
        if cfg.get("use_bidirectional_attention"):
            raise NotImplementedError("native backend does not implement bidirectional attention")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"native backend does not implement the activation {cfg['hidden_activation']!r}")
        n_layers, n_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        types = cfg.get("layer_types") or ["full_attention"] * n_layers
        if set(types) - {"full_attention", "sliding_attention"} or len(types) != n_layers:
            raise NotImplementedError(f"native backend does not implement the layer types {sorted(set(types))}")
        window = int(cfg.get("sliding_window") or 0)
        rope = cfg.get("rope_parameters") or {}
        if gemma2:  # one rope for every layer
            full = local = {**rope, "rope_theta": rope.get("rope_theta") or cfg.get("rope_theta", 10000.0)}
        else:
            full = rope.get("full_attention") or cfg.get("rope_scaling") or {"rope_theta": cfg.get("rope_theta", 1e6)}
            local = rope.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        for kind in (full, local):
            if kind.get("rope_type", kind.get("type")) not in ("default", "linear", None):
                raise NotImplementedError(f"native backend does not implement rope_scaling {kind}")
        local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0))
        if local.get("rope_type", "default") != "default":
            raise NotImplementedError(f"native backend does not implement a scaled rope on windowed layers ({local})")
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            n_layers=n_layers, n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rope_theta=float(full.get("rope_theta") or cfg.get("rope_theta", 1e6)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=full if full.get("rope_type", full.get("type")) == "linear" else None, qk_norm=not gemma2,
            norm_plus_one=True, sandwich_norms=True, embed_scale=True, activation="gelu_tanh",
            attn_scale=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256) ** -0.5,
            layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types) if window else None,
            local_rope_theta=local_theta,
            attn_softcap=float(cfg["attn_logit_softcapping"]) if cfg.get("attn_logit_softcapping") else None,
            final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
        )


def moe_settings(cfg: dict, archs: list[str]) -> dict:
    """``ModelConfig``'s mixture-of-experts fields of a Qwen3-MoE, Mixtral or OLMoE configuration ({} for
    another); ``NotImplementedError`` naming what the native decoder does not compute (a hidden activation
    other than SiLU, a shared expert; attention biases are refused for every architecture but Qwen2 by
    ``ModelConfig.from_hf``)."""
    model_type = cfg.get("model_type", "")
    if not (set(archs) & MOE_ARCHITECTURES or model_type in MOE_MODEL_TYPES):
        return {}
    name = (sorted(set(archs) & MOE_ARCHITECTURES) or [model_type])[0]
    if cfg.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"native backend does not implement {name} with the activation {cfg['hidden_act']!r}")
    if cfg.get("shared_expert_intermediate_size"):
        raise NotImplementedError(f"native backend does not implement {name} with a shared expert")
    mixtral = "MixtralForCausalLM" in archs or model_type == "mixtral"
    olmoe = "OlmoeForCausalLM" in archs or model_type == "olmoe"
    n_layers = cfg["num_hidden_layers"]
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)  # (transformers v5 writes the first)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise NotImplementedError(f"native backend does not implement {name} with {top_k} of {experts} experts a token")
    if mixtral or olmoe:  # every layer's MLP is the experts', each as wide as intermediate_size
        sparse, width = (True,) * n_layers, cfg["intermediate_size"]
    else:  # Qwen3-MoE: dense MLPs on the mlp_only_layers and off the decoder_sparse_step
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
        width = cfg["moe_intermediate_size"]
    fields = dict(sparse_layers=sparse if any(sparse) else None, n_experts=experts, experts_per_token=top_k,
                  moe_intermediate_size=int(width),
                  norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
                  moe_weights_fp32=mixtral)
    if olmoe:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:  # transformers sizes k_norm by hidden / heads
            raise NotImplementedError(f"native backend does not implement {name} with heads of {head_dim} dims "
                                      f"(hidden size / heads: {cfg['hidden_size'] // cfg['num_attention_heads']})")
        clip = cfg.get("clip_qkv")
        fields.update(qk_norm_whole=True, clip_qkv=float(clip) if clip is not None else None)
    return fields


def rope_tables(cfg: ModelConfig, max_len: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin tables, on the CPU (also inside a ``torch.device("meta")`` block, where
    a model is built before its weights are assigned: meta arithmetic imports torch._dynamo,
    ~1.7 s of a load).  ``local``: the windowed layers' (Gemma 3: plain rope of base ``local_rope_theta``)."""
    dim = cfg.rotary_dim or cfg.head_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = {} if local else cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    if kind in ("longrope", "su") and cfg.rope_freq_factors is None:  # as transformers' _compute_longrope_parameters
        ext = torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        inv_freq = 1.0 / (ext * cfg.rope_theta ** shape)
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling, as in transformers' _compute_llama3_parameters
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    if cfg.rope_freq_factors is not None and not local:  # llama.cpp's rope: each frequency divided by its factor
        factors = torch.tensor(cfg.rope_freq_factors, dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freq_factors has {factors.numel()} values; the heads' rope has {inv_freq.numel()}")
        inv_freq = inv_freq / factors
    t = torch.arange(max_len, dtype=torch.float32, device="cpu")
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if cfg.rope_attention_factor != 1.0:
        cos, sin = cos * cfg.rope_attention_factor, sin * cfg.rope_attention_factor
    if cfg.rotary_dim:  # the heads' dims in ``rotary_order``: a rotated pair at d, d + D/2; the rest unrotated
        half, r = cfg.head_dim // 2, cfg.rotary_dim // 2
        full_cos, full_sin = torch.ones(max_len, cfg.head_dim), torch.zeros(max_len, cfg.head_dim)
        for start in (0, half):
            full_cos[:, start:start + r], full_sin[:, start:start + r] = cos[:, :r], sin[:, :r]
        cos, sin = full_cos, full_sin
    return cos, sin


def rotary_order(cfg: ModelConfig) -> torch.Tensor | None:
    """Where each dim of a q or k head goes for a partial rotary embedding (None: every dim rotates): the
    rotated pairs (d, d + R/2) of transformers' layout at (d, d + D/2), the dims left unrotated in between,
    so that the kernels' rope (which pairs d with d + D/2 over the whole head) with cos 1 and sin 0 on the
    unrotated dims computes it.  q and k are permuted alike: their dot products are the same sums."""
    if not cfg.rotary_dim:
        return None
    d, r = cfg.head_dim, cfg.rotary_dim
    rest = (d - r) // 2
    return torch.cat([torch.arange(0, r // 2), torch.arange(r, r + rest), torch.arange(r // 2, r),
                      torch.arange(r + rest, d)])


def qkv_row_order(cfg: ModelConfig) -> torch.Tensor | None:
    """``rotary_order`` over the rows of the fused q/k/v projection (v's rows kept)."""
    order = rotary_order(cfg)
    if order is None:
        return None
    d = cfg.head_dim
    q = [h * d + order for h in range(cfg.n_heads)]
    k = [cfg.n_heads * d + h * d + order for h in range(cfg.n_kv_heads)]
    v = [torch.arange((cfg.n_heads + cfg.n_kv_heads) * d, (cfg.n_heads + 2 * cfg.n_kv_heads) * d)]
    return torch.cat(q + k + v)
