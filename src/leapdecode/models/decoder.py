"""The ``Decoder`` protocol: what the loop, the runner and the proposers may call on a model;
and ``LoadedModel``: a decoder with its tokenizer, what ``load()`` returns.

Both backends implement the protocol: ``native.NativeCausalLM`` (leapdecode's own Llama/Qwen2
decoder) and ``hf_backend.HFCausalLM`` (any transformers causal LM on the same KV cache).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from .kv_cache import KVCache


@runtime_checkable
class Decoder(Protocol):
    backend: str  # "native" or "hf"
    vocab_size: int
    max_seq_len: int

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def head_weight(self) -> torch.Tensor | None:
        """The output projection's plain ``[vocab, hidden]`` weight, or None where a backend cannot
        give it (then a proposer cannot build a vocabulary-subset head)."""

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """An empty tree-aware KV cache with ``batch_size`` rows (``KVCache.split_slots``)."""

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        parents: list[int] | None = None,
        logits_for: slice | list[int] | None = None,
        layers: list[int] | None = None,
        hidden_states: list | None = None,
        head: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` ([B, T]) to ``cache`` as pending tree nodes (``parents``: see
        ``KVCache.plan_append``) and return fp32 logits for the positions ``logits_for``.
        ``layers``: run only these layers (layer skipping); ``hidden_states``: a list that receives
        the residual stream after the embedding and after each layer; ``head``: a replacement
        output projection.  A backend raises ``NotImplementedError`` for what it cannot do."""


@dataclass(eq=False)
class LoadedModel:
    """A decoder (native or HF backend, same interface) with its tokenizer.

    Compared and hashed by identity (``eq=False``): a model is keyed in weak dictionaries."""

    name: str
    model: Decoder  # NativeCausalLM or HFCausalLM (models/decoder.py)
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    path: Path | None = None
    eos_token_ids: set[int] = field(default_factory=set)
    draft_name: str | None = None  # registered same-tokenizer draft, if any
    # where ``path`` holds no weights: a callable giving a context manager that yields the GGUF they are
    # read from (issue 62; e.g. for a transformers copy of the model: ``hf_backend.transformers_model``)
    gguf: Callable[[], AbstractContextManager[Path]] | None = None

    @property
    def backend(self) -> str:
        return self.model.backend

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def weights(self) -> str:
        """The weight format: ``"int8"``/``"int4"`` for a quantized native model
        (``models/quant.py``), else the dtype's short name (``"bf16"``, ``"fp32"``, ``"fp16"``)."""
        quantized = getattr(self.model, "quantization", None)
        if quantized:
            return quantized
        names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
        return names.get(self.dtype, str(self.dtype).removeprefix("torch."))

    def __repr__(self) -> str:
        return f"LoadedModel({self.name!r}, backend={self.backend}, dtype={self.dtype}, device={self.device})"
