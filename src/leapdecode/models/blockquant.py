"""Native models on leapdecode's block-quantized kernel (``qkernel``): weights ``"int4"``.

From a GGUF (a registered model or a ``.gguf`` file) every linear layer keeps the file's own
blocks (``gguf_blocks``: Q4_K / Q4_0 / Q4_1 as 4-bit codes, Q5_* / Q6_K as 6-bit codes, Q8_0 as
8-bit codes, each with its exact fp32 scales and offsets): the weights are bit for bit those
llama.cpp multiplies by.  They are packed tensor by tensor straight from the file
(``pack_gguf``, reading through ``gguf_tensors``: llama.cpp's q/k permutation undone by the
architecture's rule), without a float copy of the model; a mixture of experts' 3-D expert tensors an
expert at a time, each expert's gate/up and down a ``QLinear`` of its own (its router stays float,
``models/moe.py``).  From a plain float checkpoint, linear layers are quantized to 4-bit codes in
groups of 32 (``gguf_blocks.quantize_q4``).

The embedding and the norms run in bf16 (the kernel's activation dtype; the embedding is the
``gguf`` package's dequantization of the file's rows, rounded to bf16); the output head runs on
the kernel with fp32 logits.  The packed model is cached as one safetensors file per model,
format and CPU instruction set (written to a temporary file and renamed), so a warm load maps it
back in about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..errors import ModelFileError
from .architecture import qkv_row_order
from .native import NativeCausalLM
from .gguf_tensors import GGUFTensors, heads_of
from .gguf_blocks import requantized_warning
from .kernel_library import isa_key
from .qkernel import QLinear, QPart
from .quant import ACT_DTYPE, BLOCK_LINEARS, to_activation_dtype
from .store import (cache_dir, digest_path, digest_problem, fault_point, owned_temp, progress, say, sweep_stale,
                    writable, write_digest)

LAYOUT_VERSION = 6  # 6: Q2_K, Q3_K and the IQ4 types in 2-bit, 3-bit codes and IQ4 indices; 5: a GGUF's embedding in its own blocks (BlockEmbedding), not in bf16
# HF-side pieces of each fused native linear, with their GGUF names
GGUF_PARTS = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w_gate_up": ("ffn_gate", "ffn_up"),
    "w_down": ("ffn_down",),
}


class BlockEmbedding(nn.Module):
    """A GGUF's token embedding kept in the file's own blocks: a token's row is dequantized by the
    ``gguf`` package when it is looked up, so its values are bit for bit those of a dequantized
    table (what transformers' loader gives, rounded to bf16), while the table stays the file's size
    (a 1.5B's 152k x 1536 table: 191 MB of Q4_K rows for 467 MB of bf16)."""

    CHUNK_ROWS = 8192

    def __init__(self, rows: torch.Tensor, qtype: int, hidden: int) -> None:
        super().__init__()
        self.qtype, self.hidden = int(qtype), int(hidden)
        self.register_buffer("rows", rows.contiguous())  # uint8 [vocab, bytes per row]
        self.num_embeddings = rows.shape[0]
        self._weight: torch.Tensor | None = None

    def _values(self, raw: np.ndarray) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(raw, GGMLQuantizationType(self.qtype)).reshape(raw.shape[0], self.hidden)
        return torch.from_numpy(np.ascontiguousarray(values)).to(ACT_DTYPE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        return self._values(self.rows.numpy()[flat]).reshape(*ids.shape, self.hidden)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in bf16, dequantized once when first asked for (a head's fingerprint, a
        tied head's float weight); decoding never asks."""
        if self._weight is None:
            rows = self.rows.numpy()
            self._weight = torch.cat([self._values(rows[i:i + self.CHUNK_ROWS])
                                      for i in range(0, rows.shape[0], self.CHUNK_ROWS)])
        return self._weight

    def strided(self, step: int) -> torch.Tensor:
        """``weight.reshape(-1)[::step]`` from the rows it touches only, a chunk of rows at a time."""
        index = torch.arange(0, self.num_embeddings * self.hidden, step)
        needed, where = torch.unique(index // self.hidden, return_inverse=True)
        cols, out = index % self.hidden, torch.empty(index.numel(), dtype=ACT_DTYPE)
        for i in range(0, needed.numel(), self.CHUNK_ROWS):
            here = (where >= i) & (where < i + self.CHUNK_ROWS)
            out[here] = self(needed[i:i + self.CHUNK_ROWS])[where[here] - i, cols[here]]
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.hidden}, GGML type {self.qtype}"


def quantize_native(model: NativeCausalLM) -> dict[str, int]:
    """Replace every block linear and the head of a float ``model`` with ``QLinear`` layers of
    4-bit codes in groups of 32 (a checkpoint without GGUF blocks); the rest becomes bf16.  In
    place; returns the number of weights per format (``{"int4-g32": ...}``)."""
    from .gguf_blocks import quantize_q4

    if getattr(model, "quantization", None):
        raise ValueError(f"model is already quantized ({model.quantization})")
    cfg = model.cfg
    kinds = {"int4-g32": 0}

    def part(ref: torch.Tensor) -> QPart:
        w = quantize_q4(ref.detach().float().cpu().numpy())
        kinds["int4-g32"] += w.codes.size
        return QPart.from_block(w)

    with torch.no_grad():
        for block in model.layers:
            for name in BLOCK_LINEARS:
                lin = getattr(block, name)
                if lin is None:  # a sparse layer's MLP: its experts, below
                    continue
                pieces = _split(cfg, name, lin.weight)
                setattr(block, name, _fused(name, [part(ref) for ref in pieces], lin.bias,
                                            [ref.shape[0] for ref in pieces]))
            if block.moe is not None:  # each expert's gate/up and down on the kernel; the router stays float
                def expert(name: str, lin: nn.Module) -> QLinear:
                    pieces = _split(cfg, "w_" + name.split(".")[0], lin.weight)  # gate and up as two parts
                    return _fused(name, [part(ref) for ref in pieces], None, [ref.shape[0] for ref in pieces])

                block.moe.replace_linears(expert)
        head_ref = model.head_weight
        model.replace_head(_fused("lm_head", [part(head_ref)], None, [head_ref.shape[0]], out_fp32=True))
        to_activation_dtype(model)  # head_weight: dequantized from the kernel's head on demand
    model.quantization = "int4"
    model.quant_fallbacks = {}
    return kinds


def _fused(name: str, parts: list[QPart], bias: torch.Tensor | None, rows: list[int], out_fp32: bool = False) -> QLinear:
    """One ``QLinear`` of ``parts`` side by side; ``rows``: each part's rows before padding (every
    part but the last must fill its 16-row units: the kernel's outputs follow each other)."""
    if any(p.out_features != r for p, r in zip(parts[:-1], rows[:-1])):
        raise ModelFileError(f"{name}: a part's rows are not a multiple of 16")
    return QLinear(parts, bias, out_fp32=out_fp32, out_features=sum(rows))


def _split(cfg, name: str, weight: torch.Tensor) -> list[torch.Tensor]:
    if name == "wqkv":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return list(weight.split((q, kv, kv)))
    if name == "w_gate_up":
        return list(weight.chunk(2))
    return [weight]


def _qkv_part_orders(cfg, parts: int) -> list:
    """``architecture.qkv_row_order`` for the q/k/v projection read as one fused tensor or as three (each
    part's slice of it, from its own first row; v's rows keep their order)."""
    order = qkv_row_order(cfg)
    if parts == 1:
        return [order]
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [order[:q], order[q:q + kv] - q, None]


def pack_gguf(source: GGUFTensors, cfg) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict[str, int]]:
    """The packed model straight from a GGUF's blocks, one tensor at a time: (``save_packed``'s
    tensors and layouts, the number of weights per block type).  Nothing of the model is ever in
    float but the bf16 embedding and norms; the largest temporary is one tensor's decoded blocks."""
    source.check_against(cfg)
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    kinds: dict[str, int] = {}

    def linear(name: str, gguf_names: list[str], bias: torch.Tensor | None = None, out_fp32: bool = False,
               orders: list | None = None, expert: int | None = None) -> None:
        """``expert``: that expert's slice of 3-D expert tensors (``GGUFTensors.expert_block_weight``)."""
        parts, rows = [], []
        for j, g in enumerate(gguf_names):
            w, how = source.block_weight(g) if expert is None else source.expert_block_weight(g, expert)
            if orders is not None and orders[j] is not None:  # a partial rotary embedding (architecture.rotary_order)
                w = w.rows(orders[j].numpy())
            kinds[how] = kinds.get(how, 0) + w.codes.size
            rows.append(w.shape[0])
            parts.append(QPart.from_block(w))
            del w
        _record(tensors, layout, name, _fused(name, parts, bias, rows, out_fp32))

    # the head first: its decoded blocks are the largest temporary, best met before the rest is held
    tied = cfg.tie_word_embeddings or "output.weight" not in source
    linear("lm_head", ["token_embd.weight" if tied else "output.weight"], out_fp32=True)
    tensors["embed.rows"] = torch.from_numpy(source.raw("token_embd.weight"))
    layout["embed"] = {"qtype": source.qtype("token_embd.weight"), "hidden": cfg.hidden_size}
    tensors["norm"] = source.dense("output_norm.weight", ACT_DTYPE)
    with progress(f"packing {source.path.name} for the int4 kernel", source.size) as advance:
        advance(source.bytes_read)
        for i in range(cfg.n_layers):
            read = source.bytes_read
            blk = f"blk.{i}."
            sparse = bool(cfg.sparse_layers and cfg.sparse_layers[i])
            for name, gguf_parts in GGUF_PARTS.items():
                if sparse and name in ("w_gate_up", "w_down"):  # the experts' instead, below
                    continue
                if name == "wqkv" and f"{blk}attn_qkv.weight" in source:  # Phi-3: q, k, v in one tensor
                    gguf_parts = ("attn_qkv",)
                elif name == "w_gate_up" and cfg.fused_projections:  # Phi-3: ffn_up holds gate and up
                    gguf_parts = ("ffn_up",)
                bias, orders = None, None
                if name == "wqkv" and cfg.attention_bias:
                    bias = torch.cat([source.dense(f"{blk}{g}.bias") for g in gguf_parts])
                if name == "wqkv" and cfg.rotary_dim:
                    orders = _qkv_part_orders(cfg, len(gguf_parts))
                    if bias is not None:
                        bias = bias[qkv_row_order(cfg)]
                linear(f"layers.{i}.{name}", [f"{blk}{g}.weight" for g in gguf_parts], bias, orders=orders)
            tensors[f"layers.{i}.attn_norm"] = source.dense(f"{blk}attn_norm.weight", ACT_DTYPE)
            tensors[f"layers.{i}.mlp_norm"] = source.dense(f"{blk}ffn_norm.weight", ACT_DTYPE)
            if cfg.sandwich_norms:  # Gemma 3 (its ffn_norm is the norm before the MLP, as mlp_norm is here)
                tensors[f"layers.{i}.post_attn_norm"] = source.dense(f"{blk}post_attention_norm.weight", ACT_DTYPE)
                tensors[f"layers.{i}.post_mlp_norm"] = source.dense(f"{blk}post_ffw_norm.weight", ACT_DTYPE)
            if cfg.qk_norm:
                tensors[f"layers.{i}.q_norm"] = source.dense(f"{blk}attn_q_norm.weight", ACT_DTYPE)
                tensors[f"layers.{i}.k_norm"] = source.dense(f"{blk}attn_k_norm.weight", ACT_DTYPE)
            if sparse:  # the router in bf16 (as a float checkpoint's: quantize_native), each expert in its blocks
                tensors[f"layers.{i}.moe.router.weight"] = source.dense(f"{blk}ffn_gate_inp.weight", ACT_DTYPE)
                for e in range(cfg.n_experts):
                    linear(f"layers.{i}.moe.gate_up.{e}", [f"{blk}ffn_gate_exps.weight", f"{blk}ffn_up_exps.weight"],
                           expert=e)
                    linear(f"layers.{i}.moe.down.{e}", [f"{blk}ffn_down_exps.weight"], expert=e)
            advance(source.bytes_read - read)
    return tensors, layout, kinds


# --------------------------------------------------------------------------- the packed cache
def packed_path(model_dir: Path, key_source: str) -> Path:
    """Where the packed form of the model in ``model_dir`` lives: keyed by the model's name and
    source (the converted GGUF's checksum, or its files' sizes and times), the format's layout
    version and the CPU's instruction set; not by where the cache lies, so a cache that was moved
    or copied keeps using its packed files (probe F28)."""
    key = hashlib.sha256(f"{model_dir.name}|{key_source}".encode()).hexdigest()[:16]
    return cache_dir() / "packed" / f"{model_dir.name}-{key}-int4-v{LAYOUT_VERSION}-{isa_key()}.safetensors"


KEEP_PACKED = 2  # packed files kept per model name: this one and the most recent other (another source)


def prune_packed(path: Path) -> list[Path]:
    """Remove older packed files of the same model name (other sources, layouts, CPUs, or keys of
    an earlier scheme), keeping ``path`` and the ``KEEP_PACKED - 1`` most recent others; returns
    the removed ones (a 1.5B model's packed file is about 1 GB)."""
    def model_name(p: Path) -> str:  # NAME-KEY-int4-vN-ISA.safetensors -> NAME
        return p.name.split("-int4-")[0].rsplit("-", 1)[0]

    name = model_name(path)
    others = []
    for p in path.parent.glob(f"{name}-*-int4-*.safetensors"):
        if p != path and model_name(p) == name:
            with contextlib.suppress(OSError):
                others.append((p.stat().st_mtime, p))
    removed = []
    for _, p in sorted(others, reverse=True)[KEEP_PACKED - 1:]:
        for f in (p, digest_path(p)):
            with contextlib.suppress(OSError):
                f.unlink()
        removed.append(p)
    return removed


def _record(tensors: dict[str, torch.Tensor], layout: dict[str, dict], name: str, module: QLinear) -> None:
    """Add a ``QLinear``'s tensors and part layouts to a packed file's contents."""
    layout[name] = {"out_features": module.out_features, "out_fp32": module.out_fp32,
                    "parts": [p.spec() for p in module.parts]}
    for j, p in enumerate(module.parts):
        for t in ("codes", "scales", "zeros", "dsup", "zsup"):
            if getattr(p, t) is not None:
                tensors[f"{name}.parts.{j}.{t}"] = getattr(p, t)
    if module.bias is not None:
        tensors[f"{name}.bias"] = module.bias


def packed_contents(model: NativeCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """A quantized ``model``'s tensors and part layouts, as ``save_packed`` writes them."""
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, QLinear):
            _record(tensors, layout, name, module)
    for name, p in model.named_parameters():
        if ".parts." not in name:
            tensors[name] = p.detach()
    return tensors, layout


def save_packed(tensors: dict[str, torch.Tensor], layout: dict[str, dict], path: Path) -> None:
    """Write a packed model's tensors and part layouts to ``path`` atomically."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    # an owned folder, not a file: save_file writes its own .tmpXXXXXX beside its target and renames it,
    # so a packing killed mid-write leaves one folder, which the next load removes (issue 61, probe F14)
    with owned_temp(path.parent, ".packed-", folder=True) as work:
        tmp = work / path.name
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"layout": json.dumps(layout), "version": str(LAYOUT_VERSION)})
        fault_point("pack")
        write_digest(tmp, path)  # checked at every load (sampled) and by `models verify` (whole)
        os.replace(tmp, path)


def load_packed(path: Path, cfg, max_seq_len: int | None) -> NativeCausalLM:
    """A model from ``save_packed``'s file (its tensors mapped from the file, not copied); a
    ``ModelFileError`` if it is unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            layout = json.loads(f.metadata()["layout"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # corrupt or truncated cache file
        raise ModelFileError(f"cannot read the packed weights {path}: {type(e).__name__}: {e}") from None
    return packed_model(tensors, layout, cfg, max_seq_len, f"the packed weights {path}")


def packed_model(tensors: dict[str, torch.Tensor], layout: dict[str, dict], cfg, max_seq_len: int | None,
                 what: str = "the packed weights") -> NativeCausalLM:
    """The quantized model made of a packed file's contents (``ModelFileError``: some are missing)."""
    with torch.device("meta"):
        model = NativeCausalLM(cfg, max_seq_len=max_seq_len)
    try:
        for name, spec in layout.items():
            if name == "embed":
                model.embed = BlockEmbedding(tensors["embed.rows"], spec["qtype"], spec["hidden"])
                continue
            parts = [QPart(tensors[f"{name}.parts.{j}.codes"], tensors[f"{name}.parts.{j}.scales"],
                           tensors[f"{name}.parts.{j}.zeros"], dsup=tensors.get(f"{name}.parts.{j}.dsup"),
                           zsup=tensors.get(f"{name}.parts.{j}.zsup"), **ps) for j, ps in enumerate(spec["parts"])]
            bias = tensors.get(f"{name}.bias")
            if bias is not None:
                bias = bias[:spec["out_features"]]
            layer = QLinear(parts, bias, out_fp32=spec["out_fp32"], out_features=spec["out_features"])
            if name == "lm_head":
                model.replace_head(layer)
            else:  # layers.I.NAME, or an expert's layers.I.moe.gate_up.E
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, layer)
        own = {k: v for k, v in tensors.items() if ".parts." not in k and not k.endswith(".bias") and k != "embed.rows"}
        model.load_state_dict(own, strict=False, assign=True)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ModelFileError(f"{what} are incomplete ({type(e).__name__}: {e})") from None
    try:
        model.materialized()
    except ValueError as e:
        raise ModelFileError(f"{what} are incomplete ({e})") from None
    model.quantization = "int4"
    model.quant_fallbacks = {}
    return model


def load_int4(model_dir: Path, key_source: str, gguf: Callable[[], contextlib.AbstractContextManager] | None,
              max_seq_len: int | None) -> NativeCausalLM:
    """The model in ``model_dir`` on the block kernel: from the packed cache when present, else
    built (from the GGUF ``gguf()`` yields, or by 4-bit quantization) and cached."""
    from .architecture import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    path = packed_path(model_dir, key_source)
    sweep_stale(path.parent, ".packed-")  # a packing killed mid-write (issues 45 and 61, probe F14)
    sweep_stale(path.parent, ".tmp")  # safetensors' own temporary file of an earlier version's killed packing
    if path.is_file():
        problem = digest_problem(path)  # probe F04: damaged data gave NaN logits and token 0 forever
        try:
            if problem is not None:
                raise ModelFileError(f"the packed weights {path} {problem}")
            return load_packed(path, cfg, max_seq_len)
        except ModelFileError as e:
            say(f"{e}; packing again")
            with contextlib.suppress(OSError):  # a read-only cache keeps it: packed in memory below
                path.unlink(missing_ok=True)
    keep = writable(path.parent)
    if keep:
        say(f"packing {model_dir.name} for the int4 kernel (once; cached in {path.parent})")
    else:  # probe F10e: a read-only cache without this model's packed weights
        say(f"the cache {path.parent} is not writable: packing {model_dir.name} for the int4 kernel in memory "
            "(again at every load)")
    if gguf is None:  # a float checkpoint: quantized to 4-bit codes
        model = NativeCausalLM.from_pretrained(model_dir, dtype=torch.float32, max_seq_len=max_seq_len)
        kinds = quantize_native(model)
        tensors, layout = packed_contents(model)
    else:
        try:
            with gguf() as gguf_path:
                tensors, layout, kinds = pack_gguf(GGUFTensors(gguf_path, heads_of(cfg)), cfg)
        except OSError as e:  # probe F10e: a multi-part GGUF is assembled first (in the cache or the temporary folder)
            raise ModelFileError(f"cannot read {model_dir.name}'s GGUF blocks to pack them ({e.strerror or e}); "
                                 f"point LEAPDECODE_CACHE at a writable directory") from None
        model = packed_model(tensors, layout, cfg, max_seq_len)
    total = sum(kinds.values()) or 1
    say("weights: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(kinds.items())))
    warning = requantized_warning(kinds)
    if warning is not None:
        say(warning)
    if not keep:
        return model
    try:
        save_packed(tensors, layout, path)
    except Exception as e:  # noqa: BLE001  (probes F10e, F12b: read-only cache, disk full: OSError, SafetensorError)
        say(f"warning: cannot keep the packed weights in {path.parent} ({type(e).__name__}: {e}); using them "
            "from memory, and they are packed again at the next load")
        return model
    prune_packed(path)
    return model
