"""Both backends implement the typed ``Decoder`` protocol (models/decoder.py), including hidden
states handed to a proposer through ``forward(hidden_states=...)``."""

import torch
import transformers

from leapdecode.models.decoder import Decoder
from leapdecode.models.hf_backend import HFCausalLM
from leapdecode.models.native import NativeCausalLM
from leapdecode.models.tiny import tiny_loaded


def _hf_llama() -> HFCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return HFCausalLM(transformers.LlamaForCausalLM(cfg).eval(), max_seq_len=64)


def test_both_backends_are_decoders():
    native = tiny_loaded("tiny-random", seed=0, dtype=torch.float32, device=torch.device("cpu")).model
    assert isinstance(native, NativeCausalLM) and isinstance(native, Decoder)
    hf = _hf_llama()
    assert isinstance(hf, Decoder)
    assert hf.head_weight is None and native.head_weight is not None
    assert not isinstance(object(), Decoder)


def test_hidden_states_from_the_forward():
    for model in (tiny_loaded("tiny-random", seed=0, dtype=torch.float32, device=torch.device("cpu")).model,
                  _hf_llama()):
        cache = model.new_cache(max_len=32)
        hidden: list = []
        ids = torch.tensor([[1, 5, 7, 9]])
        logits = model.forward(ids, cache, hidden_states=hidden)
        assert len(hidden) == model.n_layers + 1, type(model).__name__
        assert all(h.shape[:2] == (1, 4) for h in hidden)
        # asking for them changes nothing in the logits
        cache2 = model.new_cache(max_len=32)
        assert torch.equal(model.forward(ids, cache2), logits)
