"""Native PyTorch masked-diffusion language models: the LLaDA and Dream families.

Both are Llama-style transformers run **without a causal mask**: every position attends to every
other, and the decoders fill ``mask_token_id`` positions in parallel.  They differ in two ways
that matter to a decoder:

- **LLaDA** ("Large Language Diffusion Models", Nie et al., 2025; ``ML-GSAI/LLaDA``): the logits at
  position ``i`` predict the token at position ``i`` (a mask predictor).  Its checkpoints use the
  OLMo-style names of the reference ``modeling_llada.py`` (``model.transformer.blocks.N.q_proj``,
  ``ff_proj`` = the SwiGLU gate, ``up_proj``, ``ff_out`` = down projection, ``attn_norm``,
  ``ff_norm``, ``transformer.ln_f``, ``transformer.ff_out`` = the output head unless
  ``weight_tying``) and a config of ``d_model``/``n_heads``/``n_layers``/``mlp_hidden_size``...
  Mask token 126336 in LLaDA-8B.
- **Dream** ("Dream 7B: Diffusion Large Language Models", Ye et al., 2025; ``DreamLM/Dream``): a
  Qwen2 transformer (bias on the q/k/v projections) initialised from Qwen2.5 and trained with
  **shifted** predictions, as it inherits from its autoregressive init: the output at position
  ``i`` predicts the token at ``i + 1``.  Its reference ``generation_utils.py`` realigns them with
  ``logits = cat([logits[:, :1], logits[:, :-1]])``; ``DiffusionLM.predict`` does the same, so a
  decoder always sees ``logits[:, i]`` = the distribution of the token at ``i``.  Names are
  Qwen2's (``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``, ``lm_head``).  Mask token
  151666 in Dream-v0-7B.

Checkpoints are read by tensor name from ``config.json`` + ``*.safetensors`` (sharded or not),
never through the checkpoints' own remote code.  ``save_pretrained`` writes the same layout back
(the round trip is tested).  A model holds weights only: decoding state lives in the decoders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidParameterError, ModelFileError
from ..models.architecture import ModelConfig, rope_tables
from ..models.native import apply_rope, rms_norm

FAMILIES = ("llada", "dream")
# rope tables are built for at most this many positions (Dream-7B declares 131072: 134 MB of fp32
# tables for canvases that are a few thousand tokens long)
MAX_CANVAS = 16384


@dataclass
class DiffusionConfig:
    """A diffusion LM's architecture: the Llama-style ``ModelConfig`` of ``models/architecture.py`` plus
    what a masked-diffusion model adds."""

    family: str  # "llada" | "dream"
    base: ModelConfig
    mask_token_id: int
    shift: bool  # True: the output at i predicts the token at i + 1 (Dream)
    eos_token_ids: tuple[int, ...] = ()
    input_emb_norm: bool = False  # LLaDA option: embeddings scaled by sqrt(d_model)
    scale_logits: bool = False  # LLaDA option: logits scaled by 1/sqrt(d_model)
    embedding_size: int | None = None  # LLaDA: rows of the embedding (>= vocab_size)
    hf: dict = field(default_factory=dict)  # the checkpoint's config.json as read

    @property
    def rows(self) -> int:
        return self.embedding_size or self.base.vocab_size


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def family_of(cfg: dict) -> str | None:
    """"llada", "dream" or None (not a diffusion LM this package implements)."""
    model_type = str(cfg.get("model_type", "")).lower()
    archs = [a.lower() for a in cfg.get("architectures") or []]
    if model_type == "llada" or any(a.startswith("llada") for a in archs):
        return "llada"
    if model_type == "dream" or any(a.startswith("dream") for a in archs):
        return "dream"
    return None


def config_from_hf(cfg: dict) -> DiffusionConfig:
    """Read a LLaDA or Dream ``config.json`` (already parsed)."""
    family = family_of(cfg)
    if family == "llada":
        unsupported = {
            "alibi": cfg.get("alibi", False),
            "attention_layer_norm": cfg.get("attention_layer_norm", False),
            "include_bias": cfg.get("include_bias", False),
            "multi_query_attention": cfg.get("multi_query_attention") or False,
        }
        bad = [k for k, v in unsupported.items() if v]
        if cfg.get("block_type", "llama") != "llama":
            bad.append(f"block_type={cfg.get('block_type')}")
        if cfg.get("layer_norm_type", "rms") != "rms":
            bad.append(f"layer_norm_type={cfg.get('layer_norm_type')}")
        if cfg.get("activation_type", "silu") not in ("silu", "swiglu"):
            bad.append(f"activation_type={cfg.get('activation_type')}")
        if cfg.get("block_group_size", 1) != 1:
            bad.append("block_group_size")
        if bad:
            raise ModelFileError(f"LLaDA checkpoint uses options this native implementation lacks: {', '.join(bad)}")
        d_model, n_heads = cfg["d_model"], cfg["n_heads"]
        mlp = cfg.get("mlp_hidden_size") or cfg.get("mlp_ratio", 4) * d_model
        base = ModelConfig(
            vocab_size=cfg["vocab_size"], hidden_size=d_model, intermediate_size=mlp, n_layers=cfg["n_layers"],
            n_heads=n_heads, n_kv_heads=cfg.get("n_kv_heads") or n_heads, head_dim=d_model // n_heads,
            max_position_embeddings=cfg.get("max_sequence_length", 4096), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), tie_word_embeddings=bool(cfg.get("weight_tying", False)),
            attention_bias=bool(cfg.get("include_qkv_bias", False)))
        return DiffusionConfig("llada", base, mask_token_id=int(cfg.get("mask_token_id", 126336)), shift=False,
                               eos_token_ids=_eos_ids(cfg), input_emb_norm=bool(cfg.get("input_emb_norm", False)),
                               scale_logits=bool(cfg.get("scale_logits", False)),
                               embedding_size=cfg.get("embedding_size"), hf=dict(cfg))
    if family == "dream":
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelFileError(f"Dream checkpoint with hidden_act={cfg.get('hidden_act')!r} is not implemented")
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("default", None):
            raise ModelFileError(f"Dream checkpoint with rope_scaling {rope_scaling} is not implemented")
        n_heads = cfg["num_attention_heads"]
        base = ModelConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            n_layers=cfg["num_hidden_layers"], n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg["hidden_size"] // n_heads, max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=True)
        if cfg.get("mask_token_id") is None:
            raise ModelFileError("Dream config.json has no mask_token_id")
        return DiffusionConfig("dream", base, mask_token_id=int(cfg["mask_token_id"]), shift=True,
                               eos_token_ids=_eos_ids(cfg), hf=dict(cfg))
    raise ModelFileError(f"not a LLaDA or Dream checkpoint (model_type={cfg.get('model_type')!r}, "
                         f"architectures={cfg.get('architectures')})")


# ------------------------------------------------------------------ the network
class DiffusionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden_size, q_out, bias=cfg.attention_bias)
        self.k = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.v = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.o = nn.Linear(q_out, cfg.hidden_size, bias=False)
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x``: [B, T, hidden] at the positions ``cos``/``sin`` were taken for; ``past``: keys and
        values ([B, kv_heads, P, D], rope applied) of other positions that these tokens also attend
        to.  Full (bidirectional) attention.  Returns the output and this call's keys/values."""
        cfg = self.cfg
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm, cfg.rms_norm_eps)
        q = self.q(h).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        # rope in fp32, as both references do (LLaDA's rope_full_precision, Dream's fp32 tables)
        q = apply_rope(q.float(), cos, sin).to(x.dtype)
        k = apply_rope(k.float(), cos, sin).to(x.dtype)
        new_kv = (k, v)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        h = rms_norm(x, self.mlp_norm, cfg.rms_norm_eps)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), new_kv


KV = list[tuple[torch.Tensor, torch.Tensor]]


class DiffusionLM(nn.Module):
    """A bidirectional transformer over a whole canvas (prompt + masked answer).

    ``forward`` returns the network's raw logits; ``predict`` realigns them (Dream's shift) so that
    ``predict(x)[:, i]`` is always the distribution of the token at position ``i``."""

    def __init__(self, cfg: DiffusionConfig) -> None:
        super().__init__()
        self.config = cfg
        base = cfg.base
        # zeros, not a random init: every caller assigns the weights (architecture.rope_tables says why)
        self.embed = nn.Embedding(cfg.rows, base.hidden_size, _weight=torch.zeros(cfg.rows, base.hidden_size))
        self.blocks = nn.ModuleList(DiffusionBlock(base) for _ in range(base.n_layers))
        self.norm = nn.Parameter(torch.ones(base.hidden_size))
        self.head = None if base.tie_word_embeddings else nn.Linear(base.hidden_size, cfg.rows, bias=False)
        # None: float weights (the network's dtype); "int8"/"int4": ``loaded.quantize_network`` replaced
        # the linear layers and the head with weight-only quantized ones
        self.quantization: str | None = None
        cos, sin = rope_tables(base, min(base.max_position_embeddings, MAX_CANVAS))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_rope(self) -> "DiffusionLM":
        """Rebuild the rope tables in fp32 on the model's device (``.to(dtype)`` would round them)."""
        cos, sin = rope_tables(self.config.base, self.max_seq_len)
        self.rope_cos, self.rope_sin = cos.to(self.device), sin.to(self.device)
        return self

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def shift(self) -> bool:
        return self.config.shift

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def max_seq_len(self) -> int:
        """The longest canvas (prompt + answer) this network runs."""
        return min(self.config.base.max_position_embeddings, MAX_CANVAS)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, past: KV | None = None,
                return_kv: bool = False, attn_mask: torch.Tensor | None = None):
        """Raw logits (fp32, ``[B, T, vocab]``) of ``tokens`` ([B, T]) at ``positions`` (default
        ``0..T-1``), attending to each other and to ``past`` (per layer, the keys/values of other
        positions: an approximate cache of Fast-dLLM).  ``return_kv``: also return this call's
        keys/values per layer.  ``attn_mask`` (training only: attention-mask annealing): a bool
        ``[T, T]`` or ``[B, 1, T, T]`` mask, True where a query may attend to a key."""
        if attn_mask is not None and past is not None:
            raise ValueError("attn_mask and past do not combine")
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        t = tokens.shape[1]
        if positions is None:
            positions = torch.arange(t, device=tokens.device)
        if int(positions.max()) >= self.max_seq_len:
            raise InvalidParameterError(f"a canvas of {int(positions.max()) + 1} positions exceeds the model's "
                                        f"{self.max_seq_len}")
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed(tokens)
        if self.config.input_emb_norm:
            x = x * (self.config.base.hidden_size ** 0.5)
        kvs: KV = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, cos, sin, None if past is None else past[i], attn_mask)
            if return_kv:
                kvs.append(kv)
        x = rms_norm(x, self.norm, self.config.base.rms_norm_eps)
        # the head module (float or quantized) when there is one, else the tied embedding
        logits = (F.linear(x, self.embed.weight) if self.head is None else self.head(x)).float()
        if self.config.scale_logits:
            logits = logits * (1.0 / self.config.base.hidden_size ** 0.5)
        logits = logits[..., : self.config.base.vocab_size]
        return (logits, kvs) if return_kv else logits

    def realign(self, raw: torch.Tensor) -> torch.Tensor:
        """Dream's shift: the row for position i is the raw output at i - 1 (position 0 keeps its
        own, as the reference does; a decoder never asks for it: it is in the prompt)."""
        if not self.shift:
            return raw
        return torch.cat((raw[:, :1], raw[:, :-1]), dim=1)

    @torch.no_grad()
    def predict(self, tokens: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        """Aligned logits ``[B, T, vocab]`` of whole canvases.  ``rowwise``: run the batch one row at
        a time, so each row's logits are the same bits as a forward of that canvas alone (CPU
        matrix products are not batch-invariant; exact decoders verify batches of candidates)."""
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if rowwise and tokens.shape[0] > 1:
            return torch.cat([self.realign(self(row.unsqueeze(0))) for row in tokens], dim=0)
        return self.realign(self(tokens))


# ------------------------------------------------------------------ checkpoint names
def _llada_names(cfg: DiffusionConfig) -> dict[str, str]:
    """our parameter name -> the reference checkpoint's tensor name (LLaDA)."""
    out = {"embed.weight": "model.transformer.wte.weight", "norm": "model.transformer.ln_f.weight"}
    if not cfg.base.tie_word_embeddings:
        out["head.weight"] = "model.transformer.ff_out.weight"
    for i in range(cfg.base.n_layers):
        p = f"model.transformer.blocks.{i}."
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "attn_out"),
                             ("gate", "ff_proj"), ("up", "up_proj"), ("down", "ff_out")):
            out[f"blocks.{i}.{ours}.weight"] = f"{p}{theirs}.weight"
        if cfg.base.attention_bias:
            for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                out[f"blocks.{i}.{ours}.bias"] = f"{p}{theirs}.bias"
        out[f"blocks.{i}.attn_norm"] = f"{p}attn_norm.weight"
        out[f"blocks.{i}.mlp_norm"] = f"{p}ff_norm.weight"
    return out


def _dream_names(cfg: DiffusionConfig) -> dict[str, str]:
    """our parameter name -> the reference checkpoint's tensor name (Dream, Qwen2 layout)."""
    out = {"embed.weight": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not cfg.base.tie_word_embeddings:
        out["head.weight"] = "lm_head.weight"
    for i in range(cfg.base.n_layers):
        p = f"model.layers.{i}."
        for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                             ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                             ("down", "mlp.down_proj")):
            out[f"blocks.{i}.{ours}.weight"] = f"{p}{theirs}.weight"
        for ours in ("q", "k", "v"):
            out[f"blocks.{i}.{ours}.bias"] = f"{p}self_attn.{ours}_proj.bias"
        out[f"blocks.{i}.attn_norm"] = f"{p}input_layernorm.weight"
        out[f"blocks.{i}.mlp_norm"] = f"{p}post_attention_layernorm.weight"
    return out


def checkpoint_names(cfg: DiffusionConfig) -> dict[str, str]:
    return _llada_names(cfg) if cfg.family == "llada" else _dream_names(cfg)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"no .safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(path / name)))
        except Exception as e:  # a truncated or foreign file: one typed error naming it
            raise ModelFileError(f"cannot read {path / name}: {e}") from e
    return tensors


def load_network(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DiffusionLM:
    """A ``DiffusionLM`` from a LLaDA or Dream checkpoint directory (config.json + safetensors)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelFileError(f"{path} has no config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    tensors = _read_tensors(path)
    names = checkpoint_names(cfg)
    missing = [theirs for theirs in names.values() if theirs not in tensors]
    if missing:
        raise ModelFileError(f"{path}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    with torch.device("meta"):
        model = DiffusionLM(cfg)
    state = {ours: tensors[theirs] for ours, theirs in names.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rope_cos, model.rope_sin = torch.empty(0), torch.empty(0)  # rebuilt below, off the meta device
    return model.to(device=device, dtype=dtype).reset_rope().eval()


def save_pretrained(model: DiffusionLM, path: str | Path) -> Path:
    """Write ``model`` as its family's checkpoint: config.json + model.safetensors with the
    reference tensor names (what ``load_network`` and the reference code read)."""
    from safetensors.torch import save_file

    if model.quantization is not None:
        raise InvalidParameterError(f"cannot save a network with {model.quantization} weights as a checkpoint: "
                                    "save the float network (quantization happens at load time)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    params = dict(model.named_parameters())
    tensors = {theirs: params[ours].detach().contiguous().cpu() for ours, theirs in checkpoint_names(cfg).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return path


def hf_config(cfg: DiffusionConfig) -> dict[str, Any]:
    """The family's config.json for ``cfg`` (the fields the reference configs use)."""
    b = cfg.base
    eos = list(cfg.eos_token_ids)
    eos_field = eos[0] if len(eos) == 1 else (eos or None)
    if cfg.family == "llada":
        out = {
            "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu",
            "block_type": "llama", "layer_norm_type": "rms", "alibi": False, "rope": True,
            "d_model": b.hidden_size, "n_heads": b.n_heads, "n_kv_heads": b.n_kv_heads, "n_layers": b.n_layers,
            "mlp_hidden_size": b.intermediate_size, "vocab_size": b.vocab_size,
            "embedding_size": cfg.rows, "max_sequence_length": b.max_position_embeddings,
            "rope_theta": b.rope_theta, "rms_norm_eps": b.rms_norm_eps, "weight_tying": b.tie_word_embeddings,
            "include_bias": False, "include_qkv_bias": b.attention_bias, "input_emb_norm": cfg.input_emb_norm,
            "scale_logits": cfg.scale_logits, "mask_token_id": cfg.mask_token_id, "eos_token_id": eos_field,
        }
    else:
        out = {
            "architectures": ["DreamModel"], "model_type": "Dream", "hidden_act": "silu",
            "hidden_size": b.hidden_size, "intermediate_size": b.intermediate_size,
            "num_attention_heads": b.n_heads, "num_key_value_heads": b.n_kv_heads,
            "num_hidden_layers": b.n_layers, "vocab_size": b.vocab_size,
            "max_position_embeddings": b.max_position_embeddings, "rope_theta": b.rope_theta,
            "rms_norm_eps": b.rms_norm_eps, "tie_word_embeddings": b.tie_word_embeddings,
            "mask_token_id": cfg.mask_token_id, "eos_token_id": eos_field, "rope_scaling": None,
        }
    return {k: v for k, v in out.items() if v is not None}
