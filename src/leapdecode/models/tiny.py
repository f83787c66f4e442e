"""Tiny randomly initialised models built in-process, for tests and CI.

``load("tiny-random")`` (or ``"tiny-random:SEED"``) gives a small Llama-style
native model with a byte-level tokenizer (256 byte tokens + 3 specials) and a
ChatML chat template; no download, deterministic weights.  Its output is noise,
which is exactly what lossless tests want: any drafter must reproduce the
target's tokens whatever they are.
"""

from __future__ import annotations

import torch

from .decoder import LoadedModel

from .architecture import ModelConfig
from .native import NativeCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                  additional_special_tokens=SPECIALS[1:])
    tok.chat_template = CHATML
    return tok


def tiny_config(vocab_size: int = 259, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, qkv_bias: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=hidden // heads,
                       max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attention_bias=qkv_bias)


def tiny_native(seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu", weight_std: float = 0.2,
                **cfg_kwargs) -> NativeCausalLM:
    """Random weights; with the default spread the greedy text is varied but partly repetitive
    (so n-gram drafters find matches) and the next-token distribution is far from one-hot."""
    cfg = tiny_config(**cfg_kwargs)
    g = torch.Generator().manual_seed(seed)
    model = NativeCausalLM(cfg, max_seq_len=cfg.max_position_embeddings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm"):
                p.copy_(torch.randn(p.shape, generator=g) * weight_std)
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=g))
    return model.to(device=device, dtype=dtype).eval()


def tiny_loaded(name: str = "tiny-random", seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
                **kwargs):
    tok = byte_tokenizer()
    model = tiny_native(seed=seed, dtype=dtype, device=device, **kwargs)
    eos = {tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")}
    return LoadedModel(name=name, model=model, tokenizer=tok, eos_token_ids=eos)
