"""The head store: trained heads in the model cache, each a directory with its weights and a manifest.

    <cache>/heads/<target>-<kind>-<fingerprint[:12]>/
        head.safetensors    the head's weights (safetensors)
        manifest.json       target (name, fingerprint), kind, config, data, steps, acceptance, command

Every file is written to a temporary file in the same directory and renamed over its name
(``os.replace``), the manifest last: a reader sees the old head, the new one, or (the first time)
none, never half a file.  A head is installed into the store as a whole directory (staged in the
cache root, then renamed).  Loading checks the manifest against the target: its kind and the
target's weight fingerprint (``common.fingerprint``) must match, or a typed error says which head
was found for which model.

Storage (``save_head(..., storage=)``, the manifest's ``"storage"``): by default every tensor in the
head's own dtype; ``"bf16"``: every floating-point tensor in bf16; ``"int8"``: the 2-D weight of every
``nn.Linear`` of the head as int8 codes ``q`` with a per-output-row scale ``<key>.int8_scale`` (bf16;
symmetric absmax / 127, ``w = q * scale``), the rest as by default.  Loading dequantizes into the
head's normal parameters, so every kind loads from every storage.

Heads bundled with the package (``bundled_root()``: ``leapdecode/bundled_heads/``, a directory of
head directories) are looked up after the user's store: a head in the store wins over a bundled
one whenever the store has one of the kinds asked for.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import HeadFileError, HeadMismatchError, HeadNotFoundError, InvalidParameterError
from ...models import store
from .common import fingerprint
from .eagle import Eagle3Head, EagleHead
from .hydra import HydraHeads
from .medusa import MedusaHeads

FORMAT = 1
MANIFEST = "manifest.json"
WEIGHTS = "head.safetensors"
KINDS: dict[str, type] = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": EagleHead, "eagle3": Eagle3Head}
KIND_METHOD = {"medusa": "medusa", "hydra": "hydra", "eagle": "eagle", "eagle3": "eagle"}  # the method that decodes it
STORAGES = ("int8", "bf16")  # besides the default: every tensor in the head's own dtype
INT8_SCALE = ".int8_scale"  # suffix of an int8 weight's per-row scale


def check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise InvalidParameterError(f"unknown head kind {kind!r}; choose from {', '.join(KINDS)}")
    return kind


def _kinds(kind: str | tuple[str, ...]) -> tuple[str, ...]:
    """One kind, or several accepted in order of preference (``("eagle3", "eagle")``)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    if not kinds:
        raise InvalidParameterError("no head kind given")
    return tuple(check_kind(k) for k in kinds)


def _names(kinds: tuple[str, ...]) -> str:
    return " or ".join(kinds)


def heads_root() -> Path:
    return store.cache_dir() / "heads"


def bundled_root() -> Path:
    """The heads shipped with the package (a directory of head directories), searched after the store."""
    return Path(__file__).resolve().parents[2] / "bundled_heads"


def model_slug(name: str) -> str:
    """A model name as a directory name's part (the store's heads, ``train-head``'s work directories)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(name)).name)[:60] or "model"


def store_dir(kind: str, target, fp: str | None = None) -> Path:
    """Where the store keeps ``target``'s head of ``kind``."""
    fp = fp or fingerprint(target)
    return heads_root() / f"{model_slug(target.name)}-{check_kind(kind)}-{fp[:12]}"


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file in the same directory, flushed to disk, and
    a rename."""
    store.atomic_write(path, data, durable=True)


def check_storage(storage: Any) -> str | None:
    if storage is not None and storage not in STORAGES:
        raise InvalidParameterError(f"unknown head storage {storage!r}; choose from {', '.join(STORAGES)}")
    return storage


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: ``(q int8 [N, K], scale bf16 [N])`` with ``scale = max|w_row| / 127``
    rounded to bf16 and ``q = round(w / scale)`` against the rounded scale (``models.quant.Int8Linear``'s
    quantization, so an int8-stored head loaded in fp32 and run on that kernel keeps its codes)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def linear_weights(module: nn.Module) -> list[str]:
    """The state-dict keys of the 2-D weights of ``module``'s ``nn.Linear`` layers."""
    return [f"{name}.weight" if name else "weight" for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def encode_state(module: nn.Module, storage: str | None = None) -> dict[str, torch.Tensor]:
    """``module``'s state dict as stored under ``storage`` (see the module's docstring), on the CPU."""
    check_storage(storage)
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    if storage == "bf16":
        return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    if storage == "int8":
        for key in linear_weights(module):
            state[key], state[key + INT8_SCALE] = quantize_rows(state[key])
    return state


def decode_state(state: dict[str, torch.Tensor], storage: Any, where: Path) -> dict[str, torch.Tensor]:
    """A stored state dict back in floating point (int8 weights dequantized: ``q * scale``, in fp32)."""
    if storage is not None and storage not in STORAGES:
        raise HeadFileError(f"{where}: unknown storage {storage!r} in the manifest (this leapdecode reads "
                            f"{', '.join(STORAGES)} or none)")
    state = dict(state)
    scales = {k[: -len(INT8_SCALE)]: state.pop(k) for k in list(state) if k.endswith(INT8_SCALE)}
    if scales and storage != "int8":
        raise HeadFileError(f"{where} holds int8 weights but its manifest says storage {storage!r}")
    for key, scale in scales.items():
        q = state.get(key)
        if q is None or q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0],):
            raise HeadFileError(f"{where}: {key + INT8_SCALE} does not match an int8 [rows, columns] weight {key}")
        state[key] = q.float() * scale.float()[:, None]
    stray = [k for k, v in state.items() if v.dtype == torch.int8]
    if stray:
        raise HeadFileError(f"{where}: int8 tensor(s) without a scale: {', '.join(stray[:3])}")
    return state


def save_head(directory: str | Path, module: torch.nn.Module, manifest: dict, storage: str | None = None) -> Path:
    """Write ``module``'s weights (as ``storage``: None, the module's dtype; ``"bf16"``; ``"int8"``) and
    ``manifest`` (completed with the format, kind, config and storage) into ``directory``, each
    atomically, the manifest last.  Returns the directory."""
    from safetensors.torch import save

    directory = Path(directory)
    state = encode_state(module, storage)
    atomic_write(directory / WEIGHTS, save(state))
    full = {"format": FORMAT, "kind": module.kind, "config": module.config, **manifest}
    full.pop("storage", None)
    if storage is not None:
        full["storage"] = storage
    atomic_write(directory / MANIFEST, (json.dumps(full, indent=2, sort_keys=True) + "\n").encode())
    return directory


def read_head(directory: str | Path, manifest: dict | None = None) -> tuple[torch.nn.Module, dict]:
    """The head in ``directory`` as stored (float, on the CPU; int8 weights dequantized) with its
    manifest, whatever model it was trained for.  ``HeadFileError`` for a missing or corrupt head."""
    from safetensors.torch import load

    directory = Path(directory)
    if manifest is None:
        if not directory.is_dir():
            raise HeadFileError(f"{directory} is not a directory of a trained head")
        manifest = read_manifest(directory)
    try:
        state = decode_state(load((directory / WEIGHTS).read_bytes()), manifest.get("storage"), directory / WEIGHTS)
        with torch.device("meta"):  # no random init of weights about to be replaced (~0.2 s for the 1.5B's head)
            module = KINDS[manifest["kind"]].from_config(manifest["config"])
        module.load_state_dict(state, strict=True, assign=True)
        module = module.to(torch.float32)  # (as loading into the float parameters did)
    except HeadFileError:
        raise
    except FileNotFoundError:
        raise HeadFileError(f"{directory} has a manifest but no {WEIGHTS}; train the head again") from None
    except Exception as e:  # a truncated or foreign safetensors file, or weights of another shape
        raise HeadFileError(f"{directory / WEIGHTS} is corrupt or does not match its manifest "
                            f"({type(e).__name__}: {str(e)[:200]}); train the head again") from None
    return module, manifest


def export_head(source: str | Path, out: str | Path, storage: str) -> Path:
    """Copy the head in ``source`` into ``out`` stored as ``storage`` (``"int8"`` or ``"bf16"``), its
    manifest kept (storage updated, ``exported_from`` added); atomic like ``save_head``."""
    if storage not in STORAGES:
        raise InvalidParameterError(f"unknown head storage {storage!r}; choose from {', '.join(STORAGES)}")
    module, manifest = read_head(source)
    rest = {k: v for k, v in manifest.items() if k not in ("format", "kind", "config", "storage")}
    rest["exported_from"] = {"path": str(Path(source).resolve()), "storage": manifest.get("storage")}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return save_head(out, module, rest, storage=storage)


def install(directory: str | Path, target) -> Path:
    """Copy a head directory into the store (staged in the cache root, then renamed into place);
    its manifest must match ``target``."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_manifest(manifest, manifest.get("kind"), target, directory)
    dest = store_dir(manifest["kind"], target, manifest["target"]["fingerprint"])
    key = f"head-{dest.name}"
    with store.lock(key), store.staging(key) as tmp:
        staged = tmp / "head"
        staged.mkdir()
        shutil.copy2(directory / WEIGHTS, staged / WEIGHTS)
        shutil.copy2(directory / MANIFEST, staged / MANIFEST)
        store.publish(staged, dest, tmp)
    return dest


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise HeadFileError(f"{directory} is not a trained head: it has no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadFileError(f"{path} is unreadable or corrupt ({type(e).__name__}: {e}); train the head "
                            "again with `leapdecode train-head`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("kind") not in KINDS \
            or not isinstance(manifest.get("config"), dict) or not isinstance(manifest.get("target"), dict) \
            or "fingerprint" not in manifest["target"]:
        raise HeadFileError(f"{path} is not a head manifest of format {FORMAT}; train the head again with "
                            "`leapdecode train-head`")
    return manifest


def check_manifest(manifest: dict, kind: str | tuple[str, ...] | None, target, directory: Path) -> None:
    if kind is not None and manifest["kind"] not in _kinds(kind):
        raise HeadMismatchError(f"{directory} holds a {manifest['kind']} head, not "
                                + " or ".join(f"a {k} head" for k in sorted(_kinds(kind))))
    fp = fingerprint(target)
    if manifest["target"]["fingerprint"] != fp:
        raise HeadMismatchError(
            f"{directory} holds a {manifest['kind']} head trained for {manifest['target'].get('name', '?')!r} "
            f"(weights {manifest['target']['fingerprint'][:12]}), not for the loaded {target.name!r} (weights "
            f"{fp[:12]}); train one for it: leapdecode train-head -m {target.name} --kind {manifest['kind']} "
            "--out DIR")


def find_head(kind: str | tuple[str, ...], target) -> tuple[str, Path] | None:
    """(kind, directory) of ``target``'s head of the first of the kinds ``kind`` in the store, else
    the first of them among the bundled heads (None: neither has one)."""
    kinds = _kinds(kind)
    cache, root = heads_root(), bundled_root()
    if not cache.is_dir() and not root.is_dir():
        return None
    fp = fingerprint(target)
    if cache.is_dir():
        for k in kinds:
            if (store_dir(k, target, fp) / MANIFEST).exists():
                return k, store_dir(k, target, fp)
    if root.is_dir():
        found = _scan(root, kinds, fp)
        for k in kinds:
            if k in found:
                return k, found[k]
    return None


def stored_kind(kind: str | tuple[str, ...], target) -> str | None:
    """The first of the kinds ``kind`` whose head for ``target`` the store (else the bundled heads)
    holds (None: none)."""
    found = find_head(kind, target)
    return found[0] if found else None


def load_head(kind: str | tuple[str, ...], target, path: str | Path | None = None) -> tuple[torch.nn.Module, dict]:
    """``target``'s trained head of ``kind`` (or of the first of several kinds, in order of preference,
    that is found) from ``path`` (a head directory, or a directory of head directories where the one
    for ``target`` is used; default: the store), on the target's device and dtype, with its
    manifest.  ``HeadNotFoundError`` when the store has none, ``HeadMismatchError`` when it was
    trained for another model or is of another kind, ``HeadFileError`` for a corrupt directory."""
    kinds = _kinds(kind)
    if path is None:
        found = find_head(kinds, target)
        if found is None:
            raise HeadNotFoundError(
                f"no trained {_names(kinds)} head for {target.name} in {heads_root()} (nor among the bundled heads); "
                f"train one with: leapdecode train-head -m {target.name} --kind {kinds[0]} --out DIR (or pass "
                "options head=DIR)")
        directory = found[1]
    else:
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise HeadNotFoundError(f"head directory {directory} does not exist; train one with: leapdecode "
                                    f"train-head -m {target.name} --kind {kinds[0]} --out {directory}")
        if not (directory / MANIFEST).exists():
            directory = _find_in(directory, kinds, target)
    manifest = read_manifest(directory)
    check_manifest(manifest, kinds, target, directory)
    module, _ = read_head(directory, manifest)
    if module.config["hidden"] != target.model.cfg.hidden_size:
        raise HeadMismatchError(f"{directory}: a head of width {module.config['hidden']} for a model of width "
                                f"{target.model.cfg.hidden_size}")
    module = module.to(device=target.model.device, dtype=target.model.dtype).eval()
    module.requires_grad_(False)
    return module, manifest


def _find_in(parent: Path, kinds: tuple[str, ...], target) -> Path:
    """The head of the first of ``kinds`` for ``target`` among the subdirectories of ``parent`` (a
    directory of heads, such as the store's root or a folder of ``--out`` directories)."""
    found = _scan(parent, kinds, fingerprint(target))
    for k in kinds:
        if k in found:
            return found[k]
    raise HeadNotFoundError(f"{parent} holds no trained {_names(kinds)} head for {target.name} (and is not a head "
                            f"directory); train one with: leapdecode train-head -m {target.name} --kind {kinds[0]} "
                            "--out DIR")


def _scan(parent: Path, kinds: tuple[str, ...], fp: str) -> dict[str, Path]:
    """kind -> the first subdirectory of ``parent`` (by name) holding a readable head of that kind for
    the weights ``fp``; corrupt manifests are skipped."""
    found: dict[str, Path] = {}
    for d in sorted(p for p in parent.iterdir() if (p / MANIFEST).is_file()):
        try:
            m = read_manifest(d)
        except HeadFileError:
            continue
        if m["kind"] in kinds and m["target"]["fingerprint"] == fp:
            found.setdefault(m["kind"], d)
    return found


def list_heads() -> list[dict]:
    """Every head in the store, then every bundled one: its manifest plus ``path`` and ``bundled``
    (``error`` instead of the manifest for a corrupt one)."""
    out = []
    for root, bundled in ((heads_root(), False), (bundled_root(), True)):
        if not root.is_dir():
            continue
        for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if bundled and not (d / MANIFEST).exists():
                continue  # not a head
            try:
                out.append({**read_manifest(d), "path": str(d), "bundled": bundled})
            except HeadFileError as e:
                out.append({"path": str(d), "bundled": bundled, "error": str(e)})
    return out
