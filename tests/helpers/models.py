"""Small models the tests build beside leapdecode's own ``tiny-random``: a tiny transformers Llama with
its native twin, a native model over a small vocabulary, a tiny Llama saved in Hugging Face format
(tests/test_strategies.py, test_contrastive.py, test_look_back.py, test_superposed.py, test_bench.py,
test_cache_faults.py), and a native decoder made batch-invariant (conftest's ``tiny``, test_static_step.py)."""

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


class RowInvariantLinear(torch.nn.Module):
    """``x @ weight.T`` as an elementwise product summed over the input dimension: every output
    element is reduced on its own, in the same order, whatever other rows share the call (one
    intra-op thread, as the suite runs), so a token's result does not depend on how many tokens
    share its forward.  fp32 ``F.linear`` (MKL) changes its blocking with the row count and is
    not batch invariant: it moves logits by ~1e-7, enough to flip a seeded draw that falls that
    close to a boundary of the sampling distribution's CDF (it happened: new token 9 of one
    test_sampling_same_seed case, uniform 0.8229840 against a CDF step at 0.8229835)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight  # shared with the layer it replaces (a tied head stays tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-2) * self.weight).sum(-1)


def make_batch_invariant(model) -> None:
    """Turn a float native decoder into a batch-invariant one, like the default int4 path: the
    invariant attention and ``RowInvariantLinear`` layers (weights shared, not copied)."""
    from leapdecode.models.quant import BLOCK_LINEARS

    model.attention = "invariant"
    for block in model.layers:
        for name in BLOCK_LINEARS:
            setattr(block, name, RowInvariantLinear(getattr(block, name).weight))
    model.lm_head = RowInvariantLinear(model.lm_head.weight)
