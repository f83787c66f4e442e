"""A GGUF file's tensors, read straight from the file for the native decoder (issue 62).

The GGUF is the model: its weights go tensor by tensor from the file into the kernel's layout
(``blockquant.pack_gguf``) or, where float weights are asked for, into a state dict in the target
dtype (``float_state``), never the whole model in float32 at once.  A tensor's bytes are read with
``np.fromfile`` at its offset, not through the ``gguf`` reader's memory map: pages touched through
the map stay resident for as long as the reader lives.

llama.cpp's converter permutes the rows of q and k of a model of GGUF architecture ``llama``
(Llama, Mistral, SmolLM: ``LlamaModel.permute`` in ``convert_hf_to_gguf.py``) for its rope, which
pairs neighbouring columns; the permutation is undone here by rule from the file's architecture,
for weights and biases alike, as transformers' GGUF loader does (``LlamaTensorProcessor``).
Qwen2's converter does not permute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch

from ..errors import ModelFileError

VOCAB_MATRICES = ("token_embd.weight", "output.weight")  # [vocab, hidden]: read into floats a slice at a time
PERMUTED_ARCHITECTURES = frozenset({"llama"})  # GGUF architectures whose q/k rows llama.cpp permuted

# the native decoder's GGUF tensor names and their Hugging Face names (Llama/Qwen2/Qwen3/Mistral; Phi-3's and
# Gemma's differ in a few: ``LAYER_NAMES_OF``)
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # a mixture of experts' router [experts, hidden] and its experts stacked, [experts, ff, hidden] (down:
    # [experts, hidden, ff]): Qwen3-MoE's, and Mixtral's in a file of architecture llama (models/moe.py)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
ROUTER = "ffn_gate_inp"  # a router's weights: read into floats, not packed for the kernel
LAYER_NAMES_OF = {
    "phi3": {**LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"},  # gate and up fused in ffn_up
    "gemma3": {**LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
LAYER_NAMES_OF["gemma2"] = LAYER_NAMES_OF["gemma3"]
# llama.cpp's converter stores Gemma's norm weights w as 1 + w (its RMSNorm multiplies by the weight):
# subtracted again when read, as transformers' GGUF loader does
NORM_OFFSET = {"gemma2": 1.0, "gemma3": 1.0}


class TensorInfo(NamedTuple):
    """Where a tensor lies in the file and what it is (ggml's shape: columns first)."""

    shape: tuple[int, ...]
    tensor_type: object  # gguf.GGMLQuantizationType
    n_bytes: int
    data_offset: int


def permutation(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for ``heads`` heads (as transformers' GGUF
    loader does: ``w.reshape(heads, dim, 2, -1).swapaxes(2, 1)``)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(-1)


def heads_of(cfg) -> dict[str, int]:
    """The heads of q and of k of a model configuration (``ModelConfig``), as ``GGUFTensors`` takes them."""
    return {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}


def expected_shape(cfg, gguf_name: str) -> tuple[int, ...] | None:
    """The shape (rows first) a configuration (``ModelConfig``) gives a native decoder's GGUF tensor."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    stem, _, kind = gguf_name.rpartition(".")
    part = stem.rsplit(".", 1)[-1]
    shapes = {"token_embd": (cfg.vocab_size, hidden), "output": (cfg.vocab_size, hidden), "output_norm": (hidden,),
              "attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (q, hidden), "attn_k": (kv, hidden),
              "attn_v": (kv, hidden), "attn_output": (hidden, q), "ffn_gate": (inter, hidden),
              "ffn_up": ((2 if cfg.fused_projections else 1) * inter, hidden), "ffn_down": (hidden, inter),
              "attn_q_norm": (cfg.head_dim,), "attn_k_norm": (cfg.head_dim,), "attn_qkv": (q + 2 * kv, hidden),
              "post_attention_norm": (hidden,), "post_ffw_norm": (hidden,)}
    if cfg.n_experts:
        experts, ff = cfg.n_experts, cfg.moe_intermediate_size
        shapes.update(ffn_gate_inp=(experts, hidden), ffn_gate_exps=(experts, ff, hidden),
                      ffn_up_exps=(experts, ff, hidden), ffn_down_exps=(experts, hidden, ff))
    shape = shapes.get(part)
    return shape[:1] if shape is not None and kind == "bias" else shape


def hf_name(gguf_name: str, architecture: str = "") -> str | None:
    """The Hugging Face name of a GGUF tensor of the native decoder in a file of GGUF ``architecture``
    (None: not one of them)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in MODEL_NAMES:
        return f"{MODEL_NAMES[stem]}.{kind}"
    blk, _, rest = stem.partition(".")
    layer, _, part = rest.partition(".")
    names = LAYER_NAMES_OF.get(architecture, LAYER_NAMES)
    if blk == "blk" and layer.isdigit() and part in names:
        return f"model.layers.{layer}.{names[part]}.{kind}"
    return None


class GGUFTensors:
    """The tensors of one GGUF file by name, each read from the file when asked for.

    ``heads``: the number of heads of q and of k (``{"attn_q": n, "attn_k": n_kv}``), for undoing
    llama.cpp's permutation where the file's architecture has it.  Only the tensors' places are
    kept of the ``gguf`` reader: its parsed metadata (a 150k-token vocabulary field by field) holds
    half a gigabyte."""

    def __init__(self, path: str | Path, heads: dict[str, int] | None = None) -> None:
        import gguf

        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(str(self.path))
            self.architecture = str(reader.fields["general.architecture"].contents())
            self.tensors = {t.name: TensorInfo(tuple(int(v) for v in t.shape), t.tensor_type, int(t.n_bytes),
                                               int(t.data_offset)) for t in reader.tensors}
        except Exception as e:  # the gguf package raises several kinds for a corrupt file
            raise ModelFileError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
        del reader
        self.heads = dict(heads or {})
        self.permuted = self.architecture in PERMUTED_ARCHITECTURES
        self.norm_offset = NORM_OFFSET.get(self.architecture, 0.0)
        self.size = self.path.stat().st_size
        self.bytes_read = 0  # of tensor data, for progress

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str):
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelFileError(f"{self.path.name}: no tensor {name!r}")
        return tensor

    def check_against(self, cfg) -> "GGUFTensors":
        """A ``ModelFileError`` naming the first tensor of the native decoder whose shape is not the one
        the configuration ``cfg`` gives it (a file whose metadata and tensors disagree)."""
        for name, info in self.tensors.items():
            want = expected_shape(cfg, name) if hf_name(name, self.architecture) is not None else None
            got = tuple(reversed(info.shape))
            if want is not None and got != want:
                raise ModelFileError(f"{self.path.name}: tensor {name!r} is {list(got)}, but the file's configuration "
                                     f"makes it {list(want)}")
        return self

    def shape(self, name: str) -> tuple[int, ...]:
        """Rows first (``[out, in]`` for a weight), as torch orders it; ggml stores columns first."""
        return tuple(reversed(self._tensor(name).shape))

    def qtype(self, name: str) -> int:
        return int(self._tensor(name).tensor_type)

    def raw(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor's bytes, ``[rows, bytes per row]`` uint8 (one row for a vector), read from the
        file; ``rows``: a contiguous range of rows only (``slice(start, stop)``)."""
        tensor = self._tensor(name)
        shape = self.shape(name)
        n = shape[0] if len(shape) > 1 else 1
        start, stop, _ = (rows or slice(None)).indices(n)
        row_bytes = tensor.n_bytes // n
        count = max(stop - start, 0) * row_bytes
        try:
            data = np.fromfile(self.path, dtype=np.uint8, count=count, offset=tensor.data_offset + start * row_bytes)
        except OSError as e:
            raise ModelFileError(f"cannot read tensor {name!r} of {self.path}: {e.strerror or e}") from None
        self.bytes_read += data.size
        if data.size != count:
            raise ModelFileError(f"{self.path} is truncated: tensor {name!r} ends past the end of the file")
        return data.reshape(-1, row_bytes)

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        """The rows' order that undoes llama.cpp's permutation of ``name`` (None: none to undo)."""
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if not self.permuted or part not in ("attn_q", "attn_k"):
            return None
        heads = self.heads.get(part)
        if not heads:
            raise ValueError(f"undoing the q/k permutation of {name!r} needs its number of heads")
        return permutation(rows, heads)

    def block_weight(self, name: str, fallback_group: int = 32):
        """(``BlockWeight`` ``[rows, cols]`` in the file's own blocks, how it was read: the block
        type, or ``"TYPE->Q8"`` for a type the kernel re-quantizes), rows in Hugging Face's order."""
        from .gguf_blocks import tensor_weight

        rows, cols = self.shape(name)
        w, how = tensor_weight(self.raw(name), self.qtype(name), rows, cols, fallback_group)
        order = self._row_order(name, rows)
        return (w if order is None else w.rows(order)), how

    def expert_block_weight(self, name: str, expert: int, fallback_group: int = 32):
        """``block_weight`` of one expert's ``[rows, cols]`` slice of a 3-D expert tensor (``[experts, rows,
        cols]``: each expert's rows follow each other in the file)."""
        from .gguf_blocks import tensor_weight

        experts, rows, cols = self.shape(name)
        if not 0 <= expert < experts:
            raise ModelFileError(f"{self.path.name}: tensor {name!r} has {experts} experts, not expert {expert}")
        raw = self.raw(name, slice(expert, expert + 1)).reshape(rows, -1)
        return tensor_weight(raw, self.qtype(name), rows, cols, fallback_group)

    def dense(self, name: str, dtype: torch.dtype = torch.float32, rows: slice | None = None) -> torch.Tensor:
        """The tensor dequantized by the ``gguf`` package (fp32, the bits transformers' loader gets),
        then in ``dtype``; rows in Hugging Face's order; ``rows``: those rows only (of a matrix the
        file does not permute), read a slice at a time."""
        from gguf.quants import dequantize

        raw = self.raw(name, rows)
        values = dequantize(raw, self._tensor(name).tensor_type).reshape(raw.shape[0], -1)
        order = self._row_order(name, values.shape[0]) if rows is None else None
        if order is not None:
            values = values[order]
        if self.norm_offset and name.endswith("norm.weight"):
            values = values - np.float32(self.norm_offset)
        out = torch.from_numpy(np.ascontiguousarray(values))
        shape = self.shape(name)
        return (out if len(shape) == 2 else out.reshape(shape)).to(dtype)  # a vector, or 3-D experts

    def embedding(self, name: str = "token_embd.weight", dtype: torch.dtype = torch.bfloat16,
                  chunk_rows: int = 8192) -> torch.Tensor:
        """A large matrix the file does not permute (the embedding, the output head) in ``dtype``,
        dequantized a slice of rows at a time (the float32 copy of a 7B's embedding alone is 2 GB)."""
        n, k = self.shape(name)
        out = torch.empty(n, k, dtype=dtype)
        for start in range(0, n, chunk_rows):
            out[start:start + chunk_rows] = self.dense(name, dtype, rows=slice(start, start + chunk_rows))
        return out

    def float_state(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The native decoder's tensors under their Hugging Face names, in ``dtype``, one at a time."""
        for name in self.tensors:
            hf = hf_name(name, self.architecture)
            if hf is not None:
                yield hf, (self.embedding(name, dtype) if name in VOCAB_MATRICES else self.dense(name, dtype))
