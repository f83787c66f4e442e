"""Transformers fallback decoder with the native interface (any ``AutoModelForCausalLM``).

``HFCausalLM`` wraps a Hugging Face causal LM (Gemma 3, Phi, ... anything the
native decoder does not implement) behind exactly the interface of
``native.NativeCausalLM``: ``new_cache()`` returns the same tree-aware
``kv_cache.KVCache`` and ``forward(tokens, cache, parents, logits_for)``
appends the tokens as pending tree nodes and returns fp32 logits, so tree
verification and speculative decoding run unchanged on top of it.

How the tree cache is plugged into transformers (v5):

* ``_TreeCacheAdapter`` is a ``transformers.cache_utils.Cache`` whose layers'
  ``update(k, v)`` call ``KVCache.write(layer, k, v)`` and hand back every slot
  in use.  A fresh adapter wraps the ``KVCache`` for each forward; all state
  (committed / pending slots, tree) lives in the ``KVCache``.
* Positions come from ``KVCache.plan_append`` (``committed length + depth``)
  and go in as ``position_ids``, so RoPE sees tree depths, not slot numbers.
* The attention mask is always built here, as a 4D ``[1, 1, T, slots]`` mask
  (transformers' ``create_causal_mask`` returns a 4D mask unchanged).  Models
  with mixed layer types (Gemma 3, Qwen2 with ``use_sliding_window``, ...) get
  a ``{layer_type: mask}`` dict, which their forward also takes as is; the
  sliding-window layers' mask is the tree mask AND the window.  In a tree, the
  keys a node sees are exactly its ancestor chain, and the number of visible
  keys after a slot is the position distance to the query, so the window
  ``key_pos > query_pos - window`` (transformers' ``sliding_window_overlay``)
  is ``(visible keys at or after the slot) <= window``.  The full sequence is
  kept for sliding layers (no ring buffer): memory is that of a full layer.
* ``attn_implementation`` is ``sdpa`` (bool masks), or ``eager`` (additive
  float masks) for models with attention logit soft-capping (Gemma 2), which
  sdpa refuses.  Flash / flex attention are not used: they ignore or reject
  arbitrary 4D masks.

Not supported (``NotImplementedError``): layer skipping (``layers=``),
bidirectional / non-causal models, linear-attention / chunked / KV-sharing
layer types.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .kv_cache import KVCache

_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


class _TreeCacheLayer(CacheLayerMixin):
    """One layer of the adapter: writes into the shared ``KVCache``."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "_TreeCacheAdapter", layer_idx: int, is_sliding: bool) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.owner.kv.write(self.layer_idx, key_states, value_states)
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self.owner.past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.past + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.kv.max_len

    def get_max_cache_shape(self) -> int:  # the name transformers 4.54-5.0 require of a layer
        return self.owner.kv.max_len

    def reset(self) -> None:  # the KVCache owns the data; never zero it from here
        raise NotImplementedError("reset the leapdecode KVCache instead")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("use KVCache.truncate / rollback instead")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search reordering is not supported by the tree cache")


class _TreeCacheAdapter(Cache):
    """A transformers ``Cache`` view of a leapdecode ``KVCache`` for one forward.

    ``past`` is the number of slots in use before this forward's tokens (what
    transformers calls the past length; ``plan_append`` already counted them).
    """

    def __init__(self, kv: KVCache, is_sliding: list[bool], past: int) -> None:
        self.kv = kv
        self.past = past
        super().__init__(layers=[_TreeCacheLayer(self, i, s) for i, s in enumerate(is_sliding)])


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _layer_types(cfg) -> list[str]:
    """Per-layer attention types as transformers' caches see them."""
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        try:  # transformers' own inference (e.g. Mistral: a `sliding_window` makes every layer sliding)
            from transformers.cache_utils import get_layer_types_and_kwargs

            types, _ = get_layer_types_and_kwargs(cfg)
        except Exception:  # older/newer transformers without the helper
            window = getattr(cfg, "sliding_window", None)
            if window is not None and getattr(cfg, "use_sliding_window", True):
                types = ["sliding_attention"] * n
            else:
                types = ["full_attention"] * n
    types = list(types)[:n]
    if len(types) != n:
        raise NotImplementedError(f"cannot tell the attention type of all {n} layers: {types}")
    return types


class HFCausalLM(nn.Module):
    """Any transformers causal LM behind the ``NativeCausalLM`` interface."""

    backend = "hf"

    def __init__(self, model: nn.Module, max_seq_len: int | None = None) -> None:
        super().__init__()
        config = model.config
        cfg = _text_config(config)
        if not getattr(cfg, "is_causal", True) or getattr(cfg, "use_bidirectional_attention", False):
            raise NotImplementedError("the HF backend needs a causal (not bidirectional) decoder")
        if getattr(cfg, "kv_sharing_modes", None) is not None or getattr(cfg, "num_kv_shared_layers", 0):
            raise NotImplementedError("the HF backend does not support KV sharing between layers")
        self.layer_types = _layer_types(cfg)
        unsupported = set(self.layer_types) - _SUPPORTED_LAYER_TYPES
        if unsupported:
            raise NotImplementedError(f"the HF backend does not support layer types {sorted(unsupported)}")
        window = getattr(cfg, "sliding_window", None)
        if "sliding_attention" in self.layer_types and not window:
            raise NotImplementedError("sliding-attention layers without a `sliding_window` size")
        # mask per layer type; `None` window = plain causal / tree mask
        self._windows = {t: (int(window) if t == "sliding_attention" else None) for t in set(self.layer_types)}

        # attention that honours an arbitrary 4D mask
        impl = "eager" if getattr(cfg, "attn_logit_softcapping", None) is not None else "sdpa"
        if getattr(config, "_attn_implementation", None) != impl:
            model.set_attn_implementation(impl)
        self._attn_impl = model.config._attn_implementation
        if self._attn_impl not in ("sdpa", "eager"):
            raise NotImplementedError(f"attention implementation {self._attn_impl!r} is not supported")

        self.hf = model.eval()
        self.config = config
        self.text_config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_seq_len = int(max_seq_len or getattr(cfg, "max_position_embeddings", 4096))
        self._n_layers = int(cfg.num_hidden_layers)
        n_heads = cfg.num_attention_heads
        self._n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        self._head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)

    # ------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def n_layers(self) -> int:
        return self._n_layers

    @property
    def head_weight(self) -> None:
        return None  # the transformers head is not sliced (a replacement head is not supported)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        return KVCache(
            self._n_layers,
            self._n_kv_heads,
            self._head_dim,
            min(max_len or self.max_seq_len, self.max_seq_len),
            batch_size=batch_size,
            dtype=self.dtype,
            device=self.device,
        )

    # --------------------------------------------------------------- forward
    def _masks(
        self, positions: torch.Tensor, tree: torch.Tensor | None, total: int
    ) -> dict[str, torch.Tensor | None]:
        """Bool ``[T, total]`` masks (True = attend) per layer type; ``None`` = attend to everything."""
        t = positions.shape[0]
        dev = positions.device
        out: dict[str, torch.Tensor | None] = {}
        key_pos = None
        for kind, window in self._windows.items():
            windowed = window is not None and total > window  # positions < total: else the window never bites
            if tree is None:
                if t == 1 and not windowed:
                    out[kind] = None  # one query after a chain: sees every slot
                    continue
                if key_pos is None:
                    key_pos = torch.arange(total, device=dev)
                # chain: slot == position; token i sits at position total - t + i
                m = key_pos[None, :] <= positions[:, None]
                if windowed:
                    m = m & (key_pos[None, :] > positions[:, None] - window)
            else:
                m = tree
                if windowed:
                    # visible keys are the node's ancestor chain: the count of visible keys at or after a
                    # slot is (query position - key position + 1)
                    after = m.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)
                    m = m & (after <= window)
            out[kind] = m
        return out

    def _format(self, m: torch.Tensor | None) -> torch.Tensor | None:
        if m is None:
            return None
        m = m[None, None]
        if self._attn_impl == "eager":
            return torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(
                ~m, torch.finfo(self.dtype).min
            )
        return m

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        parents: list[int] | None = None,
        logits_for: slice | list[int] | None = None,
        layers: list[int] | None = None,
        hidden_states: list | None = None,
        head: None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` ([B, T]) as pending nodes and return fp32 logits.

        Same contract as ``NativeCausalLM.forward``; ``layers`` (layer skipping)
        is only accepted when it names every layer in order, and a replacement
        ``head`` not at all.  ``hidden_states`` receives transformers' hidden states
        (the embedding output, then each layer's; transformers applies the final norm
        to the last one).
        """
        if layers is not None and list(layers) != list(range(self._n_layers)):
            raise NotImplementedError("layer skipping is not implemented on the HF backend")
        if head is not None:
            raise NotImplementedError("a replacement output head is not implemented on the HF backend")
        if tokens.dim() == 1:
            tokens = tokens[None]
        b, t = tokens.shape
        positions, tree = cache.plan_append(parents, t)
        total = cache.total
        masks = {k: self._format(m) for k, m in self._masks(positions, tree, total).items()}
        if len(masks) == 1:
            attention_mask = next(iter(masks.values()))
        else:  # mixed layer types: their forwards take a {layer_type: mask} mapping
            attention_mask = masks
        adapter = _TreeCacheAdapter(cache, [k == "sliding_attention" for k in self.layer_types], total - t)
        if logits_for is None:
            keep: int | torch.Tensor = 0
        elif isinstance(logits_for, slice):
            start, stop, step = logits_for.start, logits_for.stop, logits_for.step
            if isinstance(start, int) and start < 0 and stop is None and step in (None, 1):
                keep = min(-start, t)  # the last -start positions: HF's int `logits_to_keep`
            else:
                keep = torch.arange(t, device=tokens.device)[logits_for]
        else:
            keep = torch.as_tensor(list(logits_for), dtype=torch.long, device=tokens.device)
        out = self.hf(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=positions[None].expand(b, -1),
            past_key_values=adapter,
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=hidden_states is not None,
        )
        if hidden_states is not None:
            hidden_states.extend(out.hidden_states)
        return out.logits.float()

    # --------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_seq_len: int | None = None,
        gguf: Callable[[], AbstractContextManager[Path]] | None = None,
    ) -> "HFCausalLM":
        """``path``'s model; ``gguf``: the weights are read from the GGUF it yields (``path`` holds
        the configuration only)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        impl = "eager" if getattr(_text_config(config), "attn_logit_softcapping", None) is not None else "sdpa"
        device = torch.device(device)
        model = transformers_model(path, gguf, dtype, attn_implementation=impl, device_map=str(device))
        return cls(model, max_seq_len=max_seq_len)


def transformers_model(path: str | Path, gguf: Callable[[], AbstractContextManager[Path]] | None,
                       dtype: torch.dtype, **kwargs):
    """transformers' ``AutoModelForCausalLM`` of the model in ``path``, or, with ``gguf``, of the GGUF
    it yields (transformers' GGUF loader: a float copy in memory, made for this model only)."""
    from transformers import AutoModelForCausalLM

    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    from .convert import parse_once, quiet_transformers

    with gguf() as gguf_path, parse_once(), quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype,
                                                    **kwargs)
