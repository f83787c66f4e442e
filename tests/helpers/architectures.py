"""The native decoder against transformers on a tiny model of an architecture: its logits, tree logits
and greedy tokens, and speculation's tokens (tests/test_architectures.py and test_moe.py)."""

from __future__ import annotations

import torch

from leapdecode.models.architecture import ModelConfig
from leapdecode.models.native import NativeCausalLM

VOCAB = 288  # the byte symbols, two merges and the specials of tests/tiny_gguf.py, and spare ids


def native_of(hf: torch.nn.Module) -> NativeCausalLM:
    """The fp32 native decoder of a transformers model, from its configuration and state dict."""
    cfg = hf.config.to_dict()
    cfg["architectures"] = [type(hf).__name__]
    return NativeCausalLM.from_state_dict(ModelConfig.from_hf(cfg), dict(hf.state_dict()), max_seq_len=128)


def token_seq(n: int, seed: int) -> list[int]:
    """``n`` random token ids below ``VOCAB`` (seeded)."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_transformers_logits_and_tokens(hf: torch.nn.Module, native: NativeCausalLM, name: str) -> None:
    """The fp32 native decoder gives ``hf``'s logits (within 1e-4) over a prompt, each node of a token tree
    after it, and ``hf``'s 12 greedy tokens (``leapdecode.generate``, vanilla); also tests/test_moe.py's."""
    prompt, toks = token_seq(11, 1), token_seq(5, 2)
    parents = [-1, -1, 0, 2, 1]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
        cache = native.new_cache()
        got = native(torch.tensor([prompt]), cache)[0]
        assert (got - ref).abs().max().item() < 1e-4
        cache.commit()
        tree = native(torch.tensor([toks]), cache, parents=parents)[0]
        for i, path in enumerate([[0], [1], [0, 2], [0, 2, 3], [1, 4]]):  # each node: its path after the prompt
            want = hf(input_ids=torch.tensor([prompt + [toks[j] for j in path]])).logits[0, -1]
            assert (tree[path[-1]] - want).abs().max().item() < 1e-4, i
        ids = torch.tensor([prompt])
        hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                eos_token_id=VOCAB, pad_token_id=0)[0, len(prompt):].tolist()  # no EOS
    import leapdecode
    from leapdecode.models.decoder import LoadedModel
    from leapdecode.models.tiny import byte_tokenizer

    lm = LoadedModel(name=name, model=native, tokenizer=byte_tokenizer())
    out = leapdecode.generate(lm, prompt_ids=prompt, max_new_tokens=12, method="vanilla")
    assert out.tokens == hf_tokens


def assert_speculation_gives_vanillas_tokens(model: NativeCausalLM, name: str) -> None:
    """pld, sam and auto with their default options give vanilla's 32 greedy tokens after a repetitive prompt
    (trees their drafters build from it); also tests/test_moe.py's."""
    import leapdecode
    from leapdecode.models.decoder import LoadedModel
    from leapdecode.models.tiny import byte_tokenizer

    lm = LoadedModel(name=name, model=model, tokenizer=byte_tokenizer())
    prompt = token_seq(8, 6) * 3
    vanilla = leapdecode.generate(lm, prompt_ids=prompt, max_new_tokens=32, method="vanilla").tokens
    assert len(vanilla) == 32
    for method in ("pld", "sam", "auto"):
        out = leapdecode.generate(lm, prompt_ids=prompt, max_new_tokens=32, method=method)
        assert out.tokens == vanilla, method
