"""HFCausalLM (transformers fallback) against plain HF forwards and the native decoder.

Tiny random models built in-process from configs (no downloads).  Weights are
re-drawn with a larger spread than HF's init so that wrong masks or positions
show up far above the 1e-4 tolerance.
"""

from __future__ import annotations

import pytest
import torch

import transformers  # noqa: E402  (a dependency of leapdecode: missing is a failure, not a skip)

from leapdecode.models.hf_backend import HFCausalLM  # noqa: E402
from leapdecode.models.architecture import ModelConfig  # noqa: E402
from leapdecode.models.native import NativeCausalLM  # noqa: E402

VOCAB = 96
TOL = 1e-4
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # keep norms near their identity scale (Gemma: 1 + w, others: w)
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def _build(name: str):
    t = transformers
    if name == "gemma3":
        # window 4 < test sequences, sliding and full layers mixed
        cfg = t.Gemma3TextConfig(
            **COMMON, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            attn_implementation="sdpa",
        )
        model = t.Gemma3ForCausalLM(cfg)
    elif name == "gemma3_softcap":  # attention soft-capping: sdpa refuses it, runs on eager masks
        cfg = t.Gemma3TextConfig(
            **COMMON, num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=8,
            layer_types=["full_attention", "sliding_attention"], attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0, attn_implementation="eager",
        )
        model = t.Gemma3ForCausalLM(cfg)
    elif name == "llama":
        cfg = t.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False, attn_implementation="sdpa")
        model = t.LlamaForCausalLM(cfg)
    elif name == "qwen2":
        cfg = t.Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True, attn_implementation="sdpa")
        model = t.Qwen2ForCausalLM(cfg)
    elif name == "mistral":  # every layer sliding, no `layer_types`: a single (windowed) 4D mask
        cfg = t.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=5, attn_implementation="sdpa")
        model = t.MistralForCausalLM(cfg)
    else:
        raise KeyError(name)
    return _randomize(model, seed=len(name))


_MODELS: dict[str, tuple[torch.nn.Module, HFCausalLM]] = {}


def _get(name: str) -> tuple[torch.nn.Module, HFCausalLM]:
    if name not in _MODELS:
        torch.manual_seed(0)
        hf = _build(name)
        _MODELS[name] = (hf, HFCausalLM(hf, max_seq_len=64))
    return _MODELS[name]


@torch.no_grad()
def _plain(hf, ids: list[int]) -> torch.Tensor:
    """Reference: one full-sequence HF forward, no cache, HF's own masks."""
    return hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def _seq(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


ALL = ["gemma3", "gemma3_softcap", "llama", "qwen2", "mistral"]


def test_interface():
    hf, model = _get("gemma3")
    assert model.backend == "hf"
    assert model.vocab_size == VOCAB and model.max_seq_len == 64 and model.n_layers == 3
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert model.hf.config._attn_implementation == "sdpa"
    assert _get("gemma3_softcap")[1].hf.config._attn_implementation == "eager"
    cache = model.new_cache(max_len=32)
    assert cache.max_len == 32 and cache.k.shape == (3, 1, 2, 32, 8)
    with pytest.raises(NotImplementedError):
        model(torch.tensor([[1, 2]]), cache, layers=[0, 2])


@pytest.mark.parametrize("name", ALL)
def test_incremental_matches_full_forward(name):
    hf, model = _get(name)
    ids = _seq(12, 1)
    ref = _plain(hf, ids)
    cache = model.new_cache()
    got = [model(torch.tensor([ids[:8]]), cache)[0]]
    cache.commit()
    got.append(model(torch.tensor([ids[8:10]]), cache)[0])  # 2-token chain
    for i in (10, 11):  # single tokens, pending chain not yet committed
        got.append(model(torch.tensor([[ids[i]]]), cache)[0])
    cache.commit()
    assert cache.length == 12
    diff = (torch.cat(got) - ref).abs().max().item()
    assert diff < TOL, diff
    # logits_for, as used for prefill (last position only) and for picked rows
    cache.truncate(8)
    last = model(torch.tensor([ids[8:12]]), cache, logits_for=slice(-1, None))
    assert last.shape == (1, 1, VOCAB) and (last[0, 0] - ref[11]).abs().max() < TOL
    cache.rollback()
    picked = model(torch.tensor([ids[8:12]]), cache, logits_for=[0, 2])
    assert (picked[0] - ref[[8, 10]]).abs().max() < TOL


def test_sliding_window_matters():
    """Guard: the Gemma/Mistral tests above really exercise the window."""
    for name in ("gemma3", "mistral"):
        hf, _ = _get(name)
        ids = _seq(12, 1)
        ref = _plain(hf, ids)
        old = hf.config.sliding_window
        hf.config.sliding_window = 1000
        try:
            unwindowed = _plain(hf, ids)
        finally:
            hf.config.sliding_window = old
        assert (ref - unwindowed).abs().max() > 1e-2


# pending tree built by two forwards: nodes 0, 1 are siblings after the prefix;
# node 2 -> 0, node 3 -> 2, node 4 -> 1, node 5 -> 3 (a depth-4 branch, past the window)
TREE_1 = [-1, -1]
TREE_2 = [0, 2, 1, 3]
TREE = TREE_1 + TREE_2


def _path(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = TREE[node]
    return path[::-1]


@pytest.mark.parametrize("name", ALL)
def test_tree_forward_matches_paths(name):
    hf, model = _get(name)
    prefix = _seq(8, 2)
    toks = _seq(len(TREE), 3)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache, logits_for=slice(-1, None))
    cache.commit()
    a = model(torch.tensor([toks[:2]]), cache, parents=TREE_1)[0]
    b = model(torch.tensor([toks[2:]]), cache, parents=TREE_2)[0]
    got = torch.cat([a, b])
    for node in range(len(TREE)):
        ref = _plain(hf, prefix + [toks[i] for i in _path(node)])[-1]
        diff = (got[node] - ref).abs().max().item()
        assert diff < TOL, (node, diff)
    # siblings really see different contexts
    assert (got[2] - got[4]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ALL)
def test_commit_nontrivial_path(name):
    hf, model = _get(name)
    prefix = _seq(8, 4)
    toks = _seq(4, 5)  # node 0 and its sibling 1 at depth 0, node 2 -> 0, node 3 -> 1
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache)
    cache.commit()
    model(torch.tensor([toks]), cache, parents=[-1, -1, 0, 1])
    cache.commit([0, 2])
    assert cache.length == 10 and cache.n_pending == 0
    nxt = _seq(3, 6)
    got = model(torch.tensor([nxt]), cache)[0]
    ref = _plain(hf, prefix + [toks[0], toks[2]] + nxt)[-3:]
    diff = (got - ref).abs().max().item()
    assert diff < TOL, diff
    # rollback drops the pending chain: the same forward gives the same logits
    cache.rollback()
    again = model(torch.tensor([nxt]), cache)[0]
    assert (again - got).abs().max() < TOL


def test_batched_rows():
    hf, model = _get("gemma3")
    rows = [_seq(10, 7), _seq(10, 8)]
    cache = model.new_cache(batch_size=2)
    model(torch.tensor([r[:7] for r in rows]), cache)
    cache.commit()
    got = model(torch.tensor([r[7:] for r in rows]), cache, parents=[-1, 0, 1])
    for i, r in enumerate(rows):
        assert (got[i] - _plain(hf, r)[7:]).abs().max() < TOL


@pytest.mark.parametrize("name,arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_matches_native(name, arch):
    hf, model = _get(name)
    cfg_dict = hf.config.to_dict()
    cfg_dict["architectures"] = [arch]
    state = hf.state_dict()
    native = NativeCausalLM.from_state_dict(ModelConfig.from_hf(cfg_dict), state, max_seq_len=64)
    assert set(state) <= {"lm_head.weight"}  # emptied as it was read (a tied head is not read)
    prefix, toks = _seq(8, 9), _seq(5, 10)
    parents = [-1, -1, 0, 2, 1]
    outs = []
    for m in (model, native):
        cache = m.new_cache()
        first = m(torch.tensor([prefix]), cache)
        cache.commit()
        tree = m(torch.tensor([toks]), cache, parents=parents)
        cache.commit([1, 4])
        after = m(torch.tensor([toks[:2]]), cache)
        outs.append(torch.cat([first, tree, after], dim=1))
    diff = (outs[0] - outs[1]).abs().max().item()
    assert diff < TOL, diff


def test_from_pretrained_roundtrip(tmp_path):
    hf, model = _get("gemma3")
    hf.save_pretrained(tmp_path)
    loaded = HFCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", max_seq_len=32)
    assert loaded.max_seq_len == 32 and loaded.backend == "hf"
    assert loaded.hf.config._attn_implementation == "sdpa"
    ids = _seq(10, 11)
    cache = loaded.new_cache()
    got = loaded(torch.tensor([ids]), cache)[0]
    assert (got - _plain(hf, ids)).abs().max() < TOL
