"""Whether a model runs on the native decoder and the exact kernel here, and in the file's own
numbers (issue 63): what ``leapdecode doctor MODEL`` reports before anything is loaded.

Three questions, each answered from what ``load`` itself decides with:

* the architecture: the model's configuration read by ``architecture.ModelConfig.from_hf`` (the native
  decoder, or the transformers backend: slower, and not batch-invariant, so speculation is not
  guaranteed exact there), with the reason where it is refused;
* the kernel: ``loader.exact_kernel_problem`` (no compiler, no SIMD path: float weights, not exact);
* the block types of the GGUF's packed weights: run in their own blocks (``gguf_blocks.NATIVE_TYPES``:
  the file's numbers, so the tokens llama.cpp computes from them up to the kernel's rounding), or
  re-quantized to 8-bit codes (near-lossless, still exact against our own vanilla, but not the
  file's numbers).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Support:
    """The answer for one model (``support_of``)."""

    model: str
    architecture: str  # the transformers class its configuration names
    native: str | None  # why the native decoder does not run it (None: it does)
    kernel: str | None  # why the exact kernel cannot run on this machine (None: it can)
    types: dict[str, float] = field(default_factory=dict)  # block type -> share of the packed weights
    requantized: list[str] = field(default_factory=list)  # the types the kernel re-quantizes to 8 bits
    layers: str | None = None  # what the native decoder's layers are where they are not dense ones (a mixture of experts)

    @property
    def exact(self) -> bool:
        """Speculative output is vanilla's exactly with the default configuration."""
        return self.native is None and self.kernel is None

    def to_dict(self) -> dict:
        return {**asdict(self), "exact": self.exact}

    def lines(self) -> list[tuple[str, str, bool]]:
        """(label, text, good) lines for a report."""
        native = f"{self.architecture}: native decoder" + (f" ({self.layers})" if self.layers else "")
        arch = (native, True) if self.native is None else (
            f"{self.architecture}: transformers backend ({self.native}); slower, and speculation is not "
            "guaranteed exact there", False)
        out = [("architecture", *arch)]
        if self.types:
            shares = ", ".join(f"{t} {100 * s:.0f}%" for t, s in sorted(self.types.items(), key=lambda kv: -kv[1]))
            if self.requantized:
                out.append(("weights", f"{shares}; {', '.join(self.requantized)} re-quantized to 8-bit codes "
                                       "(not the file's numbers, 10 bits a weight)", False))
            else:
                out.append(("weights", f"{shares}: every type in the file's own blocks", True))
        if self.native is None:
            out.append(("exact here", "yes: the GGUF's blocks on the batch-invariant kernel" if self.kernel is None
                        else f"no: {self.kernel}", self.kernel is None))
        else:
            out.append(("exact here", "no: not on the native decoder", False))
        return out


def _block_types(gguf_path: Path) -> dict[str, int]:
    """Weights per GGML type of the GGUF's matrices the kernel packs (projections, a mixture's experts, and
    the output head, or the tied embedding that serves as it; not a router, which stays float)."""
    from .gguf_tensors import ROUTER, GGUFTensors, hf_name

    source = GGUFTensors(gguf_path)
    counts: dict[str, int] = {}
    tied = "output.weight" not in source
    for name, info in source.tensors.items():
        if len(info.shape) < 2 or hf_name(name, source.architecture) is None or (name == "token_embd.weight" and not tied) \
                or name.endswith(f".{ROUTER}.weight"):
            continue
        kind = getattr(info.tensor_type, "name", str(info.tensor_type))
        counts[kind] = counts.get(kind, 0) + math.prod(int(d) for d in info.shape)
    return counts


def support_of(name_or_path: str) -> Support:
    """Whether ``name_or_path`` (a registered model, a GGUF file, a converted directory or a Hugging
    Face checkpoint) runs natively and exactly here; converts a GGUF's configuration where needed."""
    import torch

    from .gguf_blocks import NATIVE_TYPES
    from .loader import exact_kernel_problem, model_files
    from .architecture import ModelConfig

    path, gguf = model_files(name_or_path)
    config = json.loads((path / "config.json").read_text())
    architecture = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    layers = None
    try:
        cfg = ModelConfig.from_hf(config)
        native = None
        if cfg.sparse_layers is not None:
            layers = (f"a mixture of experts: the top {cfg.experts_per_token} of {cfg.n_experts} experts a token on "
                      f"{sum(cfg.sparse_layers)} of {cfg.n_layers} layers, run op by op, not in one kernel call")
    except (NotImplementedError, KeyError) as e:
        native = str(e).strip("'") or type(e).__name__
    kernel = exact_kernel_problem(torch.device("cpu"))
    if gguf is None:
        kernel = kernel or ("a float checkpoint keeps float weights by default, which are not batch-invariant "
                            "(--weights int4 puts it on the exact kernel)")
        return Support(str(name_or_path), architecture, native, kernel, layers=layers)
    with gguf() as gguf_path:
        counts = _block_types(gguf_path)
    total = sum(counts.values()) or 1
    own = set(NATIVE_TYPES.values())
    return Support(str(name_or_path), architecture, native, kernel, {t: n / total for t, n in counts.items()},
                   sorted(t for t in counts if t not in own), layers)
