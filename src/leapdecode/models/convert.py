"""A GGUF's configuration and tokenizer in Hugging Face's format (``config.json``, tokenizer files
with the chat template, ``generation_config.json``, ``leapdecode.json``), read once from the file's
metadata with transformers' GGUF support into a staging directory and then published atomically
into the cache (see ``store``).  The weights are not copied: they are read from the GGUF itself
(``gguf_tensors``; issue 62: the float32 copy this module once wrote was 6.7 GB for a 1.1 GB file)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import threading
import time
from pathlib import Path

from ..errors import ModelFileError
from .store import (FORMAT_VERSION, META_FILE, fault_point, publish, say,
                    share_permissions, small_file_digests)


def leapdecode_version() -> str:
    try:
        return importlib.metadata.version("leapdecode")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"


def is_gguf(path: Path) -> bool:
    """The file starts with the GGUF magic bytes."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def inspect_gguf(gguf_path: Path) -> dict:
    """Architecture and chat template from the GGUF header; a ``ModelFileError`` if it is not
    a readable GGUF file (transformers' own error for that is misleading)."""
    try:
        import gguf
    except ImportError:
        raise ModelFileError("converting GGUF needs the `gguf` package: pip install 'leapdecode[gguf]'") from None
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        fields = reader.fields
        arch = fields["general.architecture"].contents()
        template = fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None
        vectors = {t.name: [float(v) for v in t.data.astype("float32").reshape(-1)] for t in reader.tensors
                   if t.name in ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")}

        def number(key: str):
            field = fields.get(f"{arch}.{key}")
            return None if field is None else field.contents()

        settings = {"freqs": vectors.get("rope_freqs.weight"), "short": vectors.get("rope_factors_short.weight"),
                "long": vectors.get("rope_factors_long.weight"), "attn_factor": number("rope.scaling.attn_factor"),
                "original": number("rope.scaling.original_context_length"),
                "sliding_window": number("attention.sliding_window"), "scaling": number("rope.scaling.type"),
                "factor": number("rope.scaling.factor"), "attn_softcap": number("attn_logit_softcapping"),
                "final_softcap": number("final_logit_softcapping"), "rope_dims": number("rope.dimension_count"),
                "head_dim": number("attention.key_length"), "experts": number("expert_count"),
                "experts_used": number("expert_used_count"), "expert_ff": number("expert_feed_forward_length")}
        parameters = sum(int(t.n_elements) for t in reader.tensors)
    except Exception as e:
        raise ModelFileError(f"{gguf_path} is not a valid GGUF file ({type(e).__name__}: {e})") from None
    return {"architecture": arch, "chat_template": template, "tensors": len(reader.tensors), "parameters": parameters,
            "settings": settings}


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def parse_once():
    """While transformers converts one GGUF, parse its header once and build each tensor-name
    map once.  transformers' loader reads the file anew for the config, the tokenizer and the
    weights, and builds gguf's tensor-name map once per module of the model: measured on
    ``smollm2-135m`` (2 cores), 4 parses of ~7.6 s (its 49k-entry vocabulary and merges are read
    field by field) and 397 maps of ~26 ms, most of the conversion's time.  Both are read-only
    there, so sharing them gives the same files; outside this block nothing changes."""
    import gguf

    with _PATCH_LOCK:  # the patch is process-wide: one conversion at a time holds it
        reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict = {}

        def reader(path, mode="r"):
            key = (str(path), mode)
            if key not in readers:
                readers[key] = reader_cls(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map
            readers.clear()


def _short_float(v: float) -> float:
    """The shortest decimal that rounds to the same float32, when ``v`` is a float32."""
    import numpy as np

    f32 = np.float32(v)
    return float(str(f32)) if float(f32) == v and np.isfinite(f32) else v


def supported_architecture(gguf_path: Path, header: dict) -> None:
    """A ``ModelFileError`` unless transformers' GGUF support reads the file's architecture."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # pragma: no cover - other transformers versions
        return
    named = {"qwen3moe": "qwen3_moe"}.get(header["architecture"], header["architecture"])  # as transformers renames it
    if named not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{gguf_path}: architecture {header['architecture']!r} is not supported by transformers' GGUF "
            f"loader (supported: {', '.join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a != 'general'))})"
        )


@contextlib.contextmanager
def quiet_transformers():
    """No "converting GGUF is slow" warnings: they are expected here."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _settings_from_file(cfg: dict, kept: dict) -> None:
    """What llama.cpp's converter keeps where transformers' GGUF reader does not look, back into the
    configuration (``kept``: ``inspect_gguf``'s "settings"): the heads' width (``key_length``, which the
    reader does not map for every architecture: Qwen3's configuration kept its default of 128), Llama 3.1's scaling as a tensor of per-frequency
    divisors (``rope_freqs``: ``rope_freq_factors``, applied by the native decoder), Phi-3's LongRoPE as its
    two factor tensors, attention factor and original length (the ``longrope`` parameters transformers
    computes them from), the attention window (Phi-3's), the rotated share of a head (Phi-4-mini's),
    Gemma 3's linear rope scaling, Gemma 2's soft caps, the attention scale llama.cpp gives Gemma
    models, and a mixture of experts' sizes: Qwen3-MoE's experts' width (``expert_feed_forward_length``,
    which the reader leaves at its default), and Mixtral, a file of architecture ``llama`` with experts
    (``expert_count``, ``expert_used_count``), which the reader makes a plain Llama."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if kept["head_dim"] and int(kept["head_dim"]) != head_dim:
        head_dim = cfg["head_dim"] = int(kept["head_dim"])
    if kept["freqs"]:
        cfg["rope_freq_factors"] = kept["freqs"]
    if kept["rope_dims"] and int(kept["rope_dims"]) < head_dim:  # a partial rotary embedding (Phi-4-mini)
        cfg["partial_rotary_factor"] = int(kept["rope_dims"]) / head_dim
    if kept["short"] and kept["long"]:
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        params.update(rope_type="longrope", short_factor=kept["short"], long_factor=kept["long"])
        if kept["original"]:
            params["original_max_position_embeddings"] = int(kept["original"])
        if kept["attn_factor"]:
            params["attention_factor"] = float(kept["attn_factor"])
        cfg["rope_parameters" if "rope_parameters" in cfg else "rope_scaling"] = params
    if kept["sliding_window"] and not cfg.get("sliding_window"):
        cfg["sliding_window"] = int(kept["sliding_window"])
    if kept["scaling"] == "linear" and kept["factor"] and float(kept["factor"]) != 1.0:  # Gemma 3 4B+: its full layers'
        linear = {"rope_type": "linear", "factor": float(kept["factor"])}
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            params["full_attention"] = {**params["full_attention"], **linear}
        else:
            cfg["rope_parameters" if "rope_parameters" in cfg else "rope_scaling"] = {**(params or {}), **linear}
    if cfg.get("model_type") in ("gemma2", "gemma3_text"):
        # the attention's scale as llama.cpp sets it for a Gemma GGUF, which does not store it: 1/sqrt(head_dim),
        # but 1/sqrt(hidden / heads) for the 27B models (46 layers: Gemma 2, 62: Gemma 3); transformers' reader
        # leaves its default of 256
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        big = layers == (46 if cfg["model_type"] == "gemma2" else 62)
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // heads if big else cfg.get("head_dim") or 256
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        if kept[field]:  # Gemma 2's caps, as the file gives them
            cfg[key] = float(kept[field])
    if kept.get("experts"):
        experts, used = int(kept["experts"]), int(kept["experts_used"] or 0)
        if cfg.get("model_type") in ("llama", "mistral"):  # Mixtral: llama.cpp writes it as a llama with experts
            cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=experts,
                       num_experts_per_tok=used)
        elif cfg.get("model_type") == "qwen3_moe":
            cfg.update(num_experts=experts, num_experts_per_tok=used)
            if "num_local_experts" in cfg:  # transformers v5's name of the same number
                cfg["num_local_experts"] = experts
            if kept["expert_ff"]:
                cfg["moe_intermediate_size"] = int(kept["expert_ff"])


def gguf_to_hf(gguf_path: Path, out: Path) -> dict:
    """Write a GGUF's configuration and tokenizer into ``out`` (no weights); returns info."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with parse_once(), quiet_transformers():
        header = inspect_gguf(gguf_path)
        supported_architecture(gguf_path, header)
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    out.mkdir(parents=True, exist_ok=True)

    # config: a plain checkpoint's (no GGUF quantization_config), with the causal LM's class
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture is None:
        raise ModelFileError(f"{gguf_path}: transformers has no causal language model for {config.model_type!r}")
    cfg = json.loads(config.to_json_string(use_diff=False))
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "_commit_hash", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    cfg["architectures"] = [architecture]
    _settings_from_file(cfg, header["settings"])
    for k, v in cfg.items():  # GGUF stores float32: 9.999999747378752e-06 -> 1e-05
        if isinstance(v, float):
            cfg[k] = _short_float(v)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(config).save_pretrained(str(out))

    # tokenizer, with the chat template from the GGUF metadata
    if not getattr(tokenizer, "chat_template", None) and header["chat_template"]:
        tokenizer.chat_template = header["chat_template"]
    tokenizer.save_pretrained(str(out))
    reloaded = AutoTokenizer.from_pretrained(str(out))
    sample = "Hello world!\n  def f(x):\n\treturn x * 2  # café 東京"
    if reloaded(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
        raise ModelFileError(f"tokenizer of {gguf_path} does not survive conversion")
    return {
        "architecture": architecture,
        "parameters": header["parameters"],
        "chat_template": bool(reloaded.chat_template),
    }


def convert_into_cache(gguf_path: Path, target: Path, staging_dir: Path, meta: dict, label: str) -> Path:
    """Convert into ``staging_dir/out``, check it, and rename that to ``target``: all or nothing."""
    out = staging_dir / "out"
    say(f"reading {label}'s configuration and tokenizer (once) ...")
    t0 = time.perf_counter()
    try:
        info = gguf_to_hf(gguf_path, out)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(f"cannot convert {gguf_path}: {type(e).__name__}: {e}") from None
    fault_point("convert")  # tests: a conversion killed with its files written (issue 61)
    meta = {**meta, **info, "files": small_file_digests(out), "format": FORMAT_VERSION, "leapdecode_version": leapdecode_version(),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "convert_seconds": round(time.perf_counter() - t0, 1)}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    share_permissions(out)
    publish(out, target, staging_dir)
    say(f"{label} ready ({meta['convert_seconds']:.0f} s): {target}")
    return target
