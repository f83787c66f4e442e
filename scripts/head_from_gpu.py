"""Turn `scripts/head_gpu.py`'s output into a leapdecode head directory (docs/heads.md).

On the machine that runs the target: loads the target (default format), checks that the GPU run
read the same GGUF (its sha256 against the model's `leapdecode.json`), builds the head from its
config (the norm epsilon taken from the target's config, not the GGUF's float32 rounding of it),
loads the bf16 weights, and writes `head.safetensors` and a manifest like `train-head`'s (target
name and fingerprint, data, steps, timings, the GPU run's own held-apart accuracies), then
validates it as `train-head` does (greedy decoding of HumanEval's held-apart prompts: mean
accepted tokens per target forward) and records that too.

    python scripts/head_from_gpu.py --run gpurun --out run/eagle3-1.5b [--install]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import leapdecode  # noqa: E402
from leapdecode.bench.workloads import held_apart  # noqa: E402
from leapdecode.training.data import humaneval_prompts  # noqa: E402
from leapdecode.training.train import Recipe, validate  # noqa: E402
from leapdecode.proposers.heads import KINDS, install, save_head  # noqa: E402
from leapdecode.proposers.heads.common import fingerprint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="head_gpu.py's output folder")
    ap.add_argument("--out", type=Path, required=True, help="the head directory to write")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    defaults = Recipe(kind="eagle3")  # validated as train-head validates
    ap.add_argument("--val-prompts", type=int, default=defaults.val_prompts)
    ap.add_argument("--val-tokens", type=int, default=defaults.val_tokens)
    ap.add_argument("--install", action="store_true", help="also copy it into the model cache's head store")
    ap.add_argument("--command", default=None, help="the GPU command to record in the manifest")
    a = ap.parse_args()
    meta = json.loads((a.run / "head.json").read_text())
    target = leapdecode.load(a.model)
    src = json.loads((target.path / "leapdecode.json").read_text()).get("source_sha256")
    if meta.get("target_sha256") != src:
        raise SystemExit(f"the GPU run read a GGUF with sha256 {meta.get('target_sha256')}, {a.model} is {src}")
    config = dict(meta["config"], eps=float(target.model.cfg.rms_norm_eps))
    head = KINDS[meta["kind"]].from_config(config)
    state = {}
    for i in range(int(meta["files"])):
        state.update(load_file(str(a.run / f"head-{i}.safetensors")))
    head.load_state_dict({k: v.float() for k, v in state.items()})
    head.eval()
    tok = target.tokenizer
    heldout = [tok.encode(p)[-defaults.prompt_tokens :] for i, p in enumerate(humaneval_prompts())
               if held_apart(i)][: a.val_prompts]
    recipe = meta["recipe"]
    manifest = {
        "target": {"name": target.name, "fingerprint": fingerprint(target)},
        "data": {**meta["data"], "sources": [
            "scripts/head_prompt_mix.py: Python documentation topics x instruction templates (with translate-back "
            "follow-ups), stdlib function signatures and docstrings, templated arithmetic word problems, "
            "HumanEval prompts except the held-apart ones",
            "Magpie-style requests sampled from the target's own chat template"],
            "generate_seconds": meta["timings"]["generate_s"], "feature_seconds": meta["timings"]["features_s"],
            "generated_tokens_per_s": round(meta["data"]["generated_tokens"] / meta["timings"]["generate_s"], 1)},
        "steps": meta["steps"], "train_seconds": meta["train_s"], "recipe": recipe,
        "final_loss": meta["loss"], "trained_on": meta["device"], "timings": meta["timings"],
        "gpu_heldout_top1": meta.get("heldout_top1"),
        "command": a.command or "python scripts/head_gpu.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in recipe.items() if v is not None and k not in ("out",)),
        "acceptance": None, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    save_head(a.out, head, manifest)
    manifest["acceptance"] = validate(target, meta["kind"], a.out, heldout, a.val_tokens)
    save_head(a.out, head, manifest)
    print(f"{meta['kind']} head -> {a.out}; held-apart acceptance {manifest['acceptance']}")
    if a.install:
        print(f"installed: {install(a.out, target)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
