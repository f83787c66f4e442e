"""Small models the tests build beside leapdecode's own ``tiny-random``: a tiny transformers Llama with
its native twin, a native model over a small vocabulary, a tiny Llama saved in Hugging Face format
(tests/test_strategies.py, test_contrastive.py, test_look_back.py, test_superposed.py, test_bench.py,
test_cache_faults.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from leapdecode.models.decoder import LoadedModel
from leapdecode.models.native import NativeCausalLM
from leapdecode.models.tiny import byte_tokenizer, tiny_config, tiny_native

EOS = (257, 258)  # hf_pair's end-of-sequence tokens


@functools.lru_cache(maxsize=None)
def hf_pair(seed: int = 1, std: float = 0.08, layers: int = 2):
    """A tiny transformers ``LlamaForCausalLM`` (fp32, the tiny-random shape; ``layers`` layers, tied
    embeddings) and a native ``LoadedModel`` with the same weights (``NativeCausalLM.from_state_dict``)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    hf.eval()
    native = NativeCausalLM.from_state_dict(tiny_config(layers=layers), hf.state_dict())
    name = f"hf-llama:{seed}" if layers == 2 else f"hf-llama-{layers}:{seed}"
    return hf, LoadedModel(name=name, model=native, tokenizer=byte_tokenizer(), eos_token_ids=set(EOS))


@functools.lru_cache(maxsize=None)
def small_vocab(vocab: int, seed: int = 0, std: float = 0.5, embed_scale: float = 1.0) -> LoadedModel:
    """A tiny native model over ``vocab`` tokens, the last one its end-of-sequence token (brute force
    over sequences is cheap); ``embed_scale < 1`` flattens its distributions (the head is tied)."""
    model = tiny_native(seed=seed, vocab_size=vocab, weight_std=std)
    if embed_scale != 1.0:
        with torch.no_grad():
            model.embed.weight.mul_(embed_scale)
    return LoadedModel(name=f"tiny-vocab{vocab}:{seed}", model=model, tokenizer=byte_tokenizer(),
                       eos_token_ids={vocab - 1})


def prompt_ids(lm: LoadedModel, text: str) -> list[int]:
    """``text`` in ``lm``'s tokens."""
    return lm.tokenizer.encode(text)


def tiny_hf_dir(path: Path) -> Path:
    """A tiny random Llama saved in Hugging Face format with the byte tokenizer."""
    import torch
    import transformers

    from leapdecode.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = transformers.LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path
