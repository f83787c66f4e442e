"""Tiny randomly initialised LLaDA- and Dream-family models, for tests (like ``models/tiny.py``).

Vocabulary: the byte-level tokenizer of ``models/tiny.py`` (256 bytes + 3 specials, ids 0..258)
plus a mask token (id 259), so a canvas decodes to text.  Weights are deterministic per seed.
"""

from __future__ import annotations

import torch

from ..models.architecture import ModelConfig
from ..models.tiny import byte_tokenizer
from .loaded import DiffusionModel
from .models import DiffusionConfig, DiffusionLM

TINY_VOCAB = 260
TINY_MASK = 259
TINY_EOS = 256  # <|endoftext|> in the byte tokenizer


def tiny_config(family: str = "llada", layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                tie: bool = False, max_len: int = 512) -> DiffusionConfig:
    if family not in ("llada", "dream"):
        raise ValueError(f"unknown diffusion family {family!r}")
    base = ModelConfig(vocab_size=TINY_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv_heads, head_dim=hidden // heads, max_position_embeddings=max_len,
                       rope_theta=10000.0, rms_norm_eps=1e-6 if family == "dream" else 1e-5,
                       tie_word_embeddings=tie, attention_bias=family == "dream")
    return DiffusionConfig(family, base, mask_token_id=TINY_MASK, shift=family == "dream", eos_token_ids=(TINY_EOS,))


def tiny_network(family: str = "llada", seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
                 weight_std: float = 0.2, **cfg_kwargs) -> DiffusionLM:
    cfg = tiny_config(family, **cfg_kwargs)
    g = torch.Generator().manual_seed(seed)
    model = DiffusionLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))  # not all ones: the round trip sees them
            else:
                p.copy_(torch.randn(p.shape, generator=g) * weight_std)
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=g))
    return model.to(device=device, dtype=dtype).reset_rope().eval()


def tiny_model(family: str = "llada", seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
               **kwargs) -> DiffusionModel:
    net = tiny_network(family, seed=seed, dtype=dtype, device=device, **kwargs)
    return DiffusionModel(name=f"tiny-{family}:{seed}", network=net, tokenizer=byte_tokenizer(),
                          eos_token_ids={TINY_EOS})
