"""GGUF -> Hugging Face-format conversion (float32 ``model.safetensors``, ``config.json``,
tokenizer files with the chat template, ``generation_config.json``, ``leapdecode.json``),
done once with transformers' GGUF loader into a staging directory and then published
atomically into the cache (see ``store``)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import threading
import time
from pathlib import Path

from ..errors import ModelFileError
from .store import (FORMAT_VERSION, META_FILE, WEIGHTS_FILE, fault_point, publish, safetensors_problem, say,
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
    except Exception as e:
        raise ModelFileError(f"{gguf_path} is not a valid GGUF file ({type(e).__name__}: {e})") from None
    return {"architecture": arch, "chat_template": template, "tensors": len(reader.tensors)}


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _parse_once():
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


def _load_with_transformers(gguf_path: Path, header: dict):
    """transformers' model (float32) and tokenizer from a GGUF, its architecture checked first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # pragma: no cover - other transformers versions
        GGUF_SUPPORTED_ARCHITECTURES = None
    if GGUF_SUPPORTED_ARCHITECTURES is not None and header["architecture"] not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{gguf_path}: architecture {header['architecture']!r} is not supported by transformers' GGUF "
            f"loader (supported: {', '.join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a != 'general'))})"
        )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "converting GGUF is slow" warnings are expected here
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model, tokenizer


def gguf_to_hf(gguf_path: Path, out: Path) -> dict:
    """Dequantize a GGUF into ``out`` (float32 safetensors + config + tokenizer); returns info."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    with _parse_once():
        header = inspect_gguf(gguf_path)
        model, tokenizer = _load_with_transformers(gguf_path, header)
    out.mkdir(parents=True, exist_ok=True)

    # weights: drop the tied head, make every tensor contiguous and unshared
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if hasattr(config, "get_text_config"):
        tied = tied or bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    state = model.state_dict()
    if tied and "lm_head.weight" in state:
        del state["lm_head.weight"]
    seen: set[int] = set()
    tensors = {}
    for k, v in state.items():
        v = v.detach().to(torch.float32).contiguous()
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            v = v.clone()
        seen.add(ptr)
        tensors[k] = v
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    n_params = sum(t.numel() for t in tensors.values())
    del tensors, state

    # config: a plain float32 checkpoint (no GGUF quantization_config), with architectures
    if getattr(config, "quantization_config", None) is not None:
        with contextlib.suppress(AttributeError):
            delattr(config, "quantization_config")
    cfg = json.loads(config.to_json_string(use_diff=False))
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "_commit_hash"):
        cfg.pop(k, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    for k, v in cfg.items():  # GGUF stores float32: 9.999999747378752e-06 -> 1e-05
        if isinstance(v, float):
            cfg[k] = _short_float(v)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out))
    architecture = cfg["architectures"][0]
    del model

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
        "parameters": n_params,
        "chat_template": bool(reloaded.chat_template),
        "dtype": "float32",
    }


def convert_into_cache(gguf_path: Path, target: Path, staging_dir: Path, meta: dict, label: str) -> Path:
    """Convert into ``staging_dir/out``, check it, and rename that to ``target``: all or nothing."""
    out = staging_dir / "out"
    say(f"converting {label} to safetensors (once) ...")
    t0 = time.perf_counter()
    try:
        info = gguf_to_hf(gguf_path, out)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(f"cannot convert {gguf_path}: {type(e).__name__}: {e}") from None
    fault_point("convert")  # tests: a conversion killed with its weights written (issue 61)
    problem = safetensors_problem(out / WEIGHTS_FILE)
    if problem is not None:
        raise ModelFileError(f"converting {gguf_path} wrote a bad {WEIGHTS_FILE}: it {problem}")
    meta = {**meta, **info, "files": small_file_digests(out), "format": FORMAT_VERSION, "leapdecode_version": leapdecode_version(),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "convert_seconds": round(time.perf_counter() - t0, 1)}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    share_permissions(out)
    publish(out, target, staging_dir)
    say(f"{label} ready ({meta['convert_seconds']:.0f} s): {target}")
    return target
