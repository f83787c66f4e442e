"""Tiny transformers models written as GGUF files, as llama.cpp's converter names and lays them out
(``convert_hf_to_gguf.py``): for tests of the GGUF route of each architecture (issue 63).  Not a
test module: the test files import ``write_gguf`` from here.

The tokenizer is a byte-level BPE over the 256 byte symbols, two merges and ChatML's specials, with a ChatML chat template in the file; 2-D weights are quantized by the
``gguf`` package (Q8_0 by default; or kept in F16), norms and biases kept in F32.

A mixture of experts (Qwen3-MoE, architecture ``qwen3moe``; Mixtral, architecture ``llama``) is written as
llama.cpp writes it: the router ``ffn_gate_inp`` in F32 (llama.cpp does not quantize it), the experts stacked
into 3-D tensors ``ffn_gate_exps``, ``ffn_up_exps`` ([experts, ff, hidden]) and ``ffn_down_exps`` ([experts,
hidden, ff]), each quantized like a 2-D weight, and the ``expert_count``, ``expert_used_count`` and
(``qwen3moe``) ``expert_feed_forward_length`` keys.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N.")
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
         "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
         "mlp.experts.down_proj": "ffn_down_exps"}  # a mixture of experts' (``experts_of`` splits transformers' gate_up)
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "qwen3_moe": "qwen3moe",
        "mixtral": "llama", "olmoe": "olmoe"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem in TOP:
        return f"{TOP[stem]}.{kind}"
    _, _, i, rest = stem.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}.{kind}"


def experts_of(state: dict) -> dict:
    """``state`` with transformers' fused experts (``mlp.experts.gate_up_proj`` [E, 2 ff, hidden],
    ``mlp.experts.down_proj``) as llama.cpp's three stacked tensors, under names ``gguf_name`` maps."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (its rope pairs neighbouring columns)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3.1's rope scaling: per frequency,
    1 (high), ``factor`` (low) or the smooth blend's divisor in between."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high, old = (rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"))
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model: torch.nn.Module, path: Path, qtype=None) -> Path:
    import gguf
    from tokenizers import pre_tokenizers

    T = gguf.GGMLQuantizationType
    qtype = T.Q8_0 if qtype is None else qtype
    cfg = model.config
    arch = ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    partial = getattr(cfg, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0
    w.add_rope_dimension_count(int(head_dim * partial))  # the rotated dims (Phi-4-mini: 3/4 of a head)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    # the tokenizer: byte symbols first (ids 0..255), then the specials, padded to the model's vocabulary
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "Ġ t"]  # two merges (transformers' GGUF tokenizer reader wants some)
    words = [m.replace(" ", "") for m in merges]
    tokens = symbols + words + specials
    tokens += [f"<|unused{i}|>" for i in range(cfg.vocab_size - len(tokens))]
    types = [1] * (len(symbols) + len(words)) + [3] * (len(tokens) - len(symbols) - len(words))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHATML)
    if rope.get("rope_type") == "llama3":  # llama.cpp's converter: Llama 3.1's scaling as per-frequency divisors
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    if rope.get("rope_type") == "longrope":  # Phi-3's: both factor sets as tensors, the attention factor, the length
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch == "phi3" and getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for name, tensor in experts_of(model.state_dict()).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        g = gguf_name(name)
        a = tensor.detach().float().numpy()
        if arch == "llama" and g.split(".")[-2] in ("attn_q", "attn_k"):
            a = permute(a, heads if g.split(".")[-2] == "attn_q" else kv_heads)
        if g.endswith("ffn_gate_inp.weight"):  # the router: F32, as llama.cpp keeps it
            w.add_tensor(g, a.astype(np.float32))
        elif a.ndim >= 2 and qtype == T.F16:
            w.add_tensor(g, a.astype(np.float16))
        elif a.ndim >= 2:
            w.add_tensor(g, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
