"""``load()``: a registry name, a local HF model directory, a ``.gguf`` file or a hub id
becomes a ``LoadedModel`` (decoder + tokenizer) on the native or the HF backend."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .decoder import LoadedModel  # noqa: F401  (load() returns it; re-exported)
from ..errors import InvalidParameterError, ModelFileError, UnknownModelError
from .store import say, weights_problem

HUB_ETAG_TIMEOUT_S = 5.0  # seconds to wait for the hub's file metadata (fail fast offline)


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls run natively (with AMX a forward of up to ~32 tokens
    costs about one token's; without it the cost grows past ~12: see core/cost_model.py)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"``: CUDA when available, else the CPU.  Anything else must name a device
    torch knows and this machine has: an ``InvalidParameterError`` says what is wrong."""
    if device is None or (isinstance(device, str) and device.strip() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidParameterError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = ("built without CUDA" if torch.version.cuda is None
                     else f"built for CUDA {torch.version.cuda}, but no usable GPU was found")
            raise InvalidParameterError(
                f"device {device!r}: CUDA is not available in this torch build or on this machine "
                f"(torch {torch.__version__}, {build}); use device 'cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise InvalidParameterError(
                f"device {device!r}: this machine has {count} CUDA device(s) (cuda:0 .. cuda:{count - 1})"
            )
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise InvalidParameterError(f"device {device!r}: MPS is not available here; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if not isinstance(dtype, str) or dtype not in names:
        raise InvalidParameterError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
    return names[dtype]


# Gemma's turn format (a system message is folded into the first user turn, as Gemma does)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set msgs = messages[1:] %}{% else %}{% set first = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (first if loop.first else '') + (m['content'] | trim) }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def damaged(path: Path, fname: str, e: BaseException) -> str:
    """The message for a model file that cannot be read (issue 45, probes F17-F24)."""
    return (f"the model in {path} is damaged: {fname} cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
            f"for a registered model, delete {path} and run `leapdecode models fetch NAME` to convert it again")


def _eos_ids(path: Path, tokenizer) -> set[int]:
    ids: set[int] = set()
    for fname in ("generation_config.json", "config.json"):
        f = path / fname
        if f.exists():
            try:
                eos = json.loads(f.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as e:  # probe F23: a JSONDecodeError traceback
                raise ModelFileError(damaged(path, fname, e)) from None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    # chat models end turns with these even when the config names another EOS
    for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            if tok in tokenizer.get_vocab():
                ids.add(tid)
    return ids


def check_weights(directory: Path, fix: str) -> None:
    """A ``ModelFileError`` naming the first truncated or corrupt ``*.safetensors`` file in
    ``directory`` (checked from its header and size, without reading the weights), and ``fix``."""
    bad = weights_problem(directory)
    if bad is not None:
        f, problem = bad
        raise ModelFileError(f"{f} {problem}; {fix}")


def _compile_beside_conversion(name_or_path: Any, dev: torch.device) -> None:
    """A registered model's first load converts it (most of that is one core's work) and then,
    in the default format, needs the block kernel: start compiling the kernel (~1 minute) in the
    background now, so that the two overlap."""
    from . import kernel_library, registry

    if (isinstance(name_or_path, str) and name_or_path in registry.REGISTRY and dev.type == "cpu"
            and not registry.is_converted(name_or_path)):
        kernel_library.build_in_background()


def local_model_dir(name_or_path: str) -> tuple[str, Path, str | None]:
    """Map the user's argument to (display name, HF-format directory, registered draft).

    Registered models and ``.gguf`` files are converted into the cache when missing, outdated
    or corrupt; local and hub directories are checked and reported when corrupt."""
    from . import registry

    if name_or_path in registry.REGISTRY:
        entry = registry.REGISTRY[name_or_path]
        return name_or_path, registry.ensure_converted(name_or_path), entry.draft
    p = Path(name_or_path).expanduser()
    if p.suffix == ".gguf" or (p.exists() and p.is_file()):
        if not p.exists():
            raise ModelFileError(f"model file not found: {p}")
        return p.name, registry.convert_gguf_file(p), None
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelFileError(f"{p} is not a Hugging Face model directory (no config.json)")
        check_weights(p, "replace it (download or save the model again)")
        if not _has_weights(p) and _gguf_of(str(p), p.name) is None:
            raise ModelFileError(f"{p} holds no weights (*.safetensors), nor is it a converted GGUF whose file "
                                 "is still there")
        return p.name, p, None
    looks_like_path = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 1)[-1]
    if looks_like_path or name_or_path.count("/") != 1:
        known = ", ".join(sorted(registry.REGISTRY))
        raise UnknownModelError(
            f"unknown model {name_or_path!r}: not a registered name ({known}), "
            "an existing directory or a .gguf file"
        )
    return name_or_path, _download_from_hub(name_or_path), None


def _download_from_hub(repo_id: str) -> Path:
    """Fetch a hub model; fails fast with a clear message where no hub is reachable."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise UnknownModelError(f"cannot fetch {repo_id!r}: huggingface_hub is not installed") from e
    # a short metadata timeout unless the user set one (passed as an argument: the process
    # environment is not ours to change)
    etag_timeout = HUB_ETAG_TIMEOUT_S
    with contextlib.suppress(ValueError):
        etag_timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_ETAG_TIMEOUT_S)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"],
                                      etag_timeout=etag_timeout))
    except Exception as e:
        raise UnknownModelError(
            f"model {repo_id!r} is not registered and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}); use a registered name (`leapdecode models list`), "
            "a local model directory or a .gguf file"
        ) from None
    check_weights(path, f"delete it from the Hugging Face cache to download {repo_id} again")
    return path


def _model_argument(name_or_path: Any) -> str:
    """The model argument as a non-empty string (paths accepted); an ``InvalidParameterError``
    for anything else."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        raise InvalidParameterError(
            f"model must be a string (a registered name, a model directory, a .gguf file or a hub id), "
            f"not {type(name_or_path).__name__} {name_or_path!r}"
        )
    if not name_or_path.strip():
        raise InvalidParameterError("model name is empty; use a registered name (`leapdecode models list`), "
                                    "a model directory, a .gguf file or a hub id")
    return name_or_path


WEIGHTS = ("auto", "bf16", "fp32", "int8", "int4")


def resolve_weights(weights: Any, dtype: str | torch.dtype | None, device: torch.device) -> tuple[str | None, torch.dtype]:
    """Check ``weights`` against ``dtype`` and the device: (``"int8"``/``"int4"`` or None for float
    weights, the dtype to build the model in).  Quantized weights run bf16 activations and are
    quantized from the checkpoint in fp32; an ``InvalidParameterError`` names what is wrong."""
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise InvalidParameterError(f"unknown weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    if weights in ("auto", "bf16", "fp32"):
        if weights == "auto":
            return None, resolve_dtype(dtype, device)
        wanted = torch.bfloat16 if weights == "bf16" else torch.float32
        if dtype not in (None, "auto") and resolve_dtype(dtype, device) != wanted:
            raise InvalidParameterError(f"weights {weights!r} conflicts with dtype {dtype!r}; give one of them")
        return None, wanted
    if dtype not in (None, "auto") and resolve_dtype(dtype, device) != torch.bfloat16:
        raise InvalidParameterError(f"weights {weights!r} runs bf16 activations; dtype {dtype!r} is not "
                                    "possible with it (use dtype auto or bf16)")
    if weights == "int4" and block_kernel(device):
        return weights, torch.float32
    if weights == "int4" and device.type == "cpu":
        warn_once(f"weights int4: leapdecode's GGUF-block kernel cannot run here ({exact_kernel_problem(device)}); "
                  "torch's int4 kernel instead, on re-quantized weights (not the GGUF's own blocks), much slower")
    from .quant import kernel_problem

    problem = kernel_problem(weights, device)
    if problem is not None:
        raise InvalidParameterError(f"weights {weights!r} cannot run on device {str(device)!r}: {problem}; "
                                    "use weights bf16 or fp32")
    return weights, torch.float32


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """One line on stderr, once per process for the same message."""
    if message not in _WARNED:
        _WARNED.add(message)
        say(f"warning: {message}")


def exact_kernel_problem(device: torch.device) -> str | None:
    """Why the default exact path (the GGUF's blocks on leapdecode's kernel, with a SIMD path) cannot
    run on ``device`` (None: it can)."""
    if device.type != "cpu":
        return None
    from .kernel_library import kernel_isa, kernel_problem

    problem = kernel_problem()
    if problem is None and kernel_isa() == "portable":
        problem = "the kernel compiled without AVX512-VNNI or AVX2 (its portable path is too slow to be the default)"
    return problem


def auto_weights(device: torch.device, backend: str, gguf, dtype) -> str | None:
    """``weights="auto"``: ``"int4"`` for a GGUF model on the native backend where the exact kernel runs
    (``block_kernel(simd=True)``), else None (float weights); on a CPU where the kernel cannot run, a
    one-line warning says why, and that speculative output is then not guaranteed identical to vanilla's."""
    if backend != "native" or gguf is None or dtype not in (None, "auto"):
        return None
    if block_kernel(device, simd=True):
        return "int4"
    problem = exact_kernel_problem(device)
    if problem is not None:
        warn_once(f"the exact int4 kernel cannot run here ({problem}): float weights instead, several times "
                  "slower, and speculative methods are not guaranteed to give vanilla's tokens")
    return None


def block_kernel(device: torch.device, simd: bool = False) -> bool:
    """leapdecode's own block-quantized kernel (``qkernel``, ``kernel_library``) runs here (CPU only); ``simd``: and
    on one of its SIMD paths, AVX512-VNNI or AVX2 (the portable one gives the same bits but is far
    slower, so ``weights="auto"`` does not pick it)."""
    if device.type != "cpu":
        return False
    from .kernel_library import kernel_isa, kernel_problem

    return kernel_problem() is None and (not simd or kernel_isa() != "portable")


def _gguf_of(name_or_path: str, name: str):
    """A callable giving a context manager that yields the model's GGUF path (registered
    models, ``.gguf`` files, and a converted directory of either, named by its path), or None for
    checkpoints without one."""
    from . import registry

    if name_or_path in registry.REGISTRY:
        return lambda: registry.gguf_file(name_or_path)
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return lambda: contextlib.nullcontext(p.resolve())
    if p.is_dir() and not _has_weights(p):  # a converted directory: the GGUF it was read from
        try:
            meta = json.loads((p / "leapdecode.json").read_text())
            source_name, source, sha = meta.get("name"), meta.get("source"), meta.get("source_sha256")
        except (OSError, ValueError, AttributeError):
            return None
        entry = registry.REGISTRY.get(source_name)
        if entry is not None and entry.sha256 == sha:
            return lambda: registry.gguf_file(source_name)
        if isinstance(source, str) and Path(source).is_file():
            return lambda: contextlib.nullcontext(Path(source))
    return None


def _source_key(path: Path) -> str:
    """What identifies the weights in ``path`` (the converted GGUF's checksum, or file stamps)."""
    try:
        return json.loads((path / "leapdecode.json").read_text())["source_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        stamps = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(path.glob("*.safetensors"))]
        return "|".join(stamps)


def load(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    backend: str = "auto",
    max_seq_len: int | None = None,
    weights: str = "auto",
    attention: str = "auto",
    require_exact: bool = False,
) -> LoadedModel:
    """Load a model by registry name, local HF directory, ``.gguf`` path or hub id.

    ``"tiny-random"`` / ``"tiny-random:SEED"`` build a tiny random model in-process (tests, CI).

    ``backend="auto"`` uses the native decoder for Llama/Qwen2/Mistral and the
    transformers fallback for everything else; ``"native"`` or ``"hf"`` force one.
    ``dtype="auto"`` is bf16 on CUDA or on CPUs with AMX/AVX512-BF16, else fp32.

    ``weights``: ``"auto"`` (the default: ``"int4"`` for a GGUF model on the CPU when the block
    kernel builds here with a SIMD path (AVX512-VNNI or AVX2), else float as ``dtype`` says), ``"bf16"``, ``"fp32"``, or weight-only
    ``"int8"`` (per-channel, torch's kernel) / ``"int4"`` with bf16 activations on
    batch-invariant kernels (native backend).  ``"int4"`` on the CPU runs the GGUF's own blocks
    on leapdecode's kernel (``models/blockquant.py``; 4-bit groups of 32 for a float
    checkpoint); on CUDA torch's int4 kernel (``models/quant.py``).

    ``attention``: ``"auto"`` (``"invariant"`` with int8/int4 weights, else ``"sdpa"``), ``"sdpa"``
    or ``"invariant"`` (native backend only): batch-invariant attention for forwards of up to
    64 tokens (``NativeCausalLM.attention``).

    ``require_exact``: raise ``ExactnessError`` (naming why) instead of loading a configuration in
    which speculative methods are not guaranteed to give vanilla's tokens bit for bit (float
    weights because the kernel cannot build here, the sdpa attention, the transformers backend, a
    GPU); the check comes before the weights are read.
    """
    if attention not in ("auto", "sdpa", "invariant"):
        raise InvalidParameterError(f"unknown attention {attention!r}; use auto, sdpa or invariant")
    name_or_path = _model_argument(name_or_path)
    dev = resolve_device(device)
    quantized, dt = resolve_weights(weights, dtype, dev)
    from transformers import AutoTokenizer

    from .architecture import ModelConfig

    if name_or_path == "tiny-random" or name_or_path.startswith("tiny-random:"):
        from .tiny import tiny_loaded

        try:
            seed = int(name_or_path.split(":", 1)[1]) if ":" in name_or_path else 0
        except ValueError:
            raise UnknownModelError(
                f"unknown model {name_or_path!r}: tiny random models are tiny-random or tiny-random:SEED "
                "(SEED an integer)"
            ) from None
        if require_exact:
            _check_exact(True, dev, quantized, attention)
        loaded = tiny_loaded(name_or_path, seed=seed, dtype=dt, device=dev)
        if quantized:
            _quantize(loaded.model, quantized, dev)
        loaded.model.attention = _attention(attention, quantized)
        return loaded
    if backend not in ("auto", "native", "hf"):
        raise InvalidParameterError(f"unknown backend {backend!r}; use native, hf or auto")
    if quantized and backend == "hf":
        raise InvalidParameterError(f"weights {quantized!r} needs the native backend, not hf")
    if backend != "hf" and (weights == "int4" or (weights == "auto" and dtype in (None, "auto"))):
        _compile_beside_conversion(name_or_path, dev)
    name, path, draft = local_model_dir(name_or_path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFileError(f"cannot read {path / 'config.json'}: {e}") from None
    if backend == "auto":
        try:
            ModelConfig.from_hf(config)
            backend = "native"
        except (NotImplementedError, KeyError):
            backend = "hf"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001  (probes F17, F20, F21: the tokenizer files' own errors, any type)
        raise ModelFileError(damaged(path, "its tokenizer (tokenizer.json, tokenizer_config.json)", e)) from None
    if not getattr(tokenizer, "chat_template", None) and str(config.get("model_type", "")).startswith("gemma"):
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE  # some Gemma GGUFs ship without one
    if max_seq_len is None:
        max_seq_len = min(int(config.get("max_position_embeddings", 4096)), 8192)
    if quantized and backend != "native":
        raise InvalidParameterError(f"weights {quantized!r}: {name} runs on the transformers backend "
                                    f"({config.get('architectures')}); int8/int4 need the native one")
    if attention == "invariant" and backend != "native":
        raise InvalidParameterError(f"attention {attention!r}: {name} runs on the transformers backend; "
                                    "only the native one has it")
    gguf = _gguf_of(name_or_path, name)
    float_source = None if _has_weights(path) else gguf  # where float weights are read from, if not ``path``
    if weights == "auto" and auto_weights(dev, backend, gguf, dtype) == "int4":
        quantized = "int4"  # the GGUF's own blocks on the batch-invariant kernel
    if require_exact:
        _check_exact(backend == "native", dev, quantized, attention)
    if backend == "native":
        try:
            if quantized == "int4" and block_kernel(dev):
                from .blockquant import load_int4

                model = load_int4(path, _source_key(path), gguf, max_seq_len)
            else:
                model = _float_native(path, float_source, dt, dev, max_seq_len)
        except NotImplementedError as e:
            raise InvalidParameterError(f"{name}: {e}; use --backend hf") from None
        if quantized and not getattr(model, "quantization", None):
            _quantize(model, quantized, dev)  # from the fp32 checkpoint; the rest in bf16
        elif not quantized:
            model.pack_for_cpu()  # bf16 on CPU: oneDNN-packed weights (identical results, faster)
        model.attention = _attention(attention, quantized)
        if model.max_seq_len < max_seq_len:
            say(f"{name}: context limited to {model.max_seq_len} tokens, as far as the native decoder computes this "
                "model exactly (the original length of its rope scaling)")
    else:
        from .hf_backend import HFCausalLM

        model = HFCausalLM.from_pretrained(path, dtype=dt, device=dev, max_seq_len=max_seq_len, gguf=float_source)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, path=path,
                       eos_token_ids=_eos_ids(path, tokenizer), draft_name=draft, gguf=float_source)


def model_files(name_or_path: str):
    """(The Hugging Face-format directory of a model argument, the callable yielding the GGUF its
    weights are read from, or None where the directory holds them), converting it where needed."""
    name, path, _ = local_model_dir(name_or_path)
    return path, (None if _has_weights(path) else _gguf_of(name_or_path, name))


def _has_weights(path: Path) -> bool:
    """The directory holds its weights (a Hugging Face checkpoint), not only a GGUF's configuration."""
    return any(path.glob("*.safetensors"))


def _float_native(path: Path, gguf, dtype: torch.dtype, device: torch.device, max_seq_len: int | None):
    """The native decoder with float weights in ``dtype``: from the directory's checkpoint (``gguf``
    None), or read tensor by tensor from the GGUF ``gguf()`` yields (``gguf_tensors``; the model in
    ``dtype`` is all that is held)."""
    from .architecture import ModelConfig
    from .native import NativeCausalLM

    if gguf is None:
        return NativeCausalLM.from_pretrained(path, dtype=dtype, device=device, max_seq_len=max_seq_len)
    from .gguf_tensors import GGUFTensors, heads_of

    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with gguf() as gguf_path:
        say(f"reading {gguf_path.name}'s weights into {str(dtype).removeprefix('torch.')} (float weights: "
            "the default int4 keeps the file's blocks)")
        state = dict(GGUFTensors(gguf_path, heads_of(cfg)).check_against(cfg).float_state(dtype))
        name = gguf_path.name
    try:
        return NativeCausalLM.from_state_dict(cfg, state, dtype=dtype, device=device, max_seq_len=max_seq_len)
    except KeyError as e:  # a weight the configuration needs is not in the file (e.g. a 2-D tensor per expert)
        raise ModelFileError(f"{name}: no weight {e.args[0]!r} for the native decoder (its tensors are not the ones "
                             "its configuration calls for)") from None


def _check_exact(native: bool, device: torch.device, quantized: str | None, attention: str) -> None:
    """``require_exact``: ``ExactnessError`` where the planned configuration is not batch-invariant,
    naming why (and why the exact kernel cannot run, where that is the cause)."""
    from ..errors import ExactnessError
    from .invariance import configuration_problem

    problem = configuration_problem(native, device, quantized, _attention(attention, quantized))
    if problem is None:
        return
    kernel = exact_kernel_problem(device) if native and not quantized else None
    raise ExactnessError(f"exactness is not guaranteed: {problem}"
                         + (f"; the exact int4 kernel cannot run here: {kernel}" if kernel else ""))


def _quantize(model, quantized: str, device: torch.device) -> None:
    """Quantize a float native model in memory: int4 on leapdecode's block kernel where it runs,
    else torch's weight-only kernels (``models/quant.py``)."""
    if quantized == "int4" and block_kernel(device):
        from .blockquant import quantize_native

        quantize_native(model)
    else:
        from .quant import quantize_model

        quantize_model(model, quantized)


def _attention(attention: str, quantized: str | None) -> str:
    """``"auto"``: the batch-invariant attention with batch-invariant (quantized) weights."""
    if attention == "auto":
        return "invariant" if quantized else "sdpa"
    return attention


def load_draft(name: str, target: LoadedModel) -> LoadedModel:
    """A draft model for ``target``, in the target's weight format where it can run it (a
    quantized target gets a draft on the same kernels, e.g. the 0.5B's own GGUF blocks), else
    in the target's dtype, on the target's device."""
    if getattr(target.model, "quantization", None):
        try:
            return load(name, device=target.device, weights=target.weights)
        except InvalidParameterError:
            pass  # e.g. a draft on the transformers backend: float weights as before
    return load(name, dtype=target.dtype, device=target.device, backend="auto")
