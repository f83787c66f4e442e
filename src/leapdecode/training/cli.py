"""``leapdecode train-head`` and ``leapdecode heads list``: trained draft heads (docs/heads.md).

    leapdecode train-head -m MODEL --kind medusa|hydra|eagle|eagle3 [--data humaneval stdlib magpie:N
        tokens:FILE.npz FILE ...] [--init bundled|DIR] [--resume | --restart] [--budget-minutes N]
        [--steps N] [--out DIR]
    leapdecode heads list [--json]
    leapdecode heads accuracy -m MODEL [--head DIR ...] [--per-category N] [--humaneval N] [--save FILE]
    leapdecode heads export SRC_DIR OUT_DIR --storage int8|bf16
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..models.store import check_output


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..cli_args import add_model_args
    from .train import Recipe

    d = Recipe(kind="medusa")
    t = subparsers.add_parser(
        "train-head", help="train a medusa, hydra, eagle or eagle3 head for a model (self-distillation)",
        description="Self-distillation of a draft head on the target's own features. Each run adds its --data's "
                    "new sequences (the target's own answers to HumanEval prompts and to requests it writes "
                    "itself, teacher-forced text, an earlier run's token sequences) to the data shards of a work "
                    "directory (default: the model cache's train/MODEL-KIND), trains on all of them, scores the "
                    "head per Spec-Bench category and installs it into the model cache (docs/heads.md).")
    add_model_args(t)
    t.add_argument("--kind", required=True, choices=["medusa", "hydra", "eagle", "eagle3"],
                   help="eagle3: EAGLE-3's fused layers and training-time test (decoded by --method eagle)")
    t.add_argument("--data", nargs="+", default=list(d.data), metavar="SOURCE",
                   help="humaneval (self-distilled prompts), stdlib (teacher-forced sources), magpie:N (N requests "
                        "the target writes and answers), tokens:FILE.npz (an earlier run's sequences, e.g. "
                        "scripts/head_gpu.py's), or text/JSONL files (default: %(default)s)")
    t.add_argument("--out", default=None,
                   help="work directory: data shards, checkpoint, head (default: <model cache>/train/MODEL-KIND)")
    t.add_argument("--init", default=None, metavar="HEAD",
                   help="start from a trained head instead of random weights: 'bundled' (the package's) or a "
                        "head directory")
    t.add_argument("--resume", action="store_true",
                   help="go on from the work directory's checkpoint for --steps more steps, with its data and "
                        "this run's new data")
    t.add_argument("--budget-minutes", type=float, default=d.budget_minutes,
                   help="stop training after this wall time, data extraction included (default: %(default)s)")
    t.add_argument("--steps", type=int, default=d.steps, help="most training steps this run (default: %(default)s)")
    t.add_argument("--max-prompts", type=int, default=d.max_prompts,
                   help="new self-distillation prompts per run (HumanEval, files; default: %(default)s)")
    t.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="greedy tokens generated per prompt")
    t.add_argument("--text-chunks", type=int, default=d.text_chunks,
                   help="new teacher-forced sequences per run (text chunks, tokens: sequences; default: %(default)s)")
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--batch", type=int, default=d.batch)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--medusa-heads", type=int, default=d.medusa_heads, help="heads of a medusa or hydra head")
    t.add_argument("--eagle-layers", type=int, nargs="+", default=None, metavar="I",
                   help="eagle3: the hidden states fused (0: embedding output, i: layer i's output; default: "
                        "2, N/2, N-3 of the target's N layers)")
    t.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help="eagle3: training-time test steps unrolled (default: %(default)s)")
    t.add_argument("--eagle-intermediate", type=int, default=d.eagle_intermediate,
                   help="the EAGLE layer's MLP width (default 0: the target's; smaller trains faster on a CPU)")
    t.add_argument("--train-vocab", type=int, default=d.train_vocab,
                   help="output-head rows scored in training: the lowest ids (0: all; default: %(default)s)")
    t.add_argument("--val-prompts", type=int, default=d.val_prompts, help="held-apart prompts validated")
    t.add_argument("--val-tokens", type=int, default=d.val_tokens)
    t.add_argument("--checkpoint-minutes", type=float, default=d.checkpoint_minutes)
    t.add_argument("--eval-per-category", type=int, default=d.eval_per_category,
                   help="eagle kinds: Spec-Bench dev prompts per category scored after the run (default: %(default)s)")
    t.add_argument("--eval-humaneval", type=int, default=d.eval_humaneval,
                   help="eagle kinds: HumanEval held-apart problems scored after the run (default: %(default)s)")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--threads", type=int, default=0,
                   help="torch threads (default 0: torch's own choice; on a busy shared CPU 1 avoids "
                        "OpenMP spin-waiting, which made a tiny run 60x slower here)")
    t.add_argument("--restart", action="store_true",
                   help="delete the work directory's checkpoint and data shards first")
    t.add_argument("--no-install", action="store_true", help="do not copy the head into the model cache")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train_head)

    h = subparsers.add_parser("heads", help="trained draft heads in the model cache: list, export")
    hs = h.add_subparsers(dest="heads_action", metavar="ACTION")
    ls = hs.add_parser("list", help="list the trained heads and their manifests")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_heads_list)
    ex = hs.add_parser("export", help="copy a head directory with its weights stored as int8 or bf16",
                       description="Write the head in SRC_DIR into OUT_DIR with its linear layers' weights as int8 "
                                   "(per-row scales) or every weight in bf16; the manifest is kept and records the "
                                   "storage. Every kind loads from either (docs/heads.md).")
    ex.add_argument("src", metavar="SRC_DIR", help="a head directory (head.safetensors and manifest.json)")
    ex.add_argument("out", metavar="OUT_DIR", help="where to write the copy (created if needed)")
    ex.add_argument("--storage", required=True, choices=["int8", "bf16"])
    ex.set_defaults(func=cmd_heads_export)
    ac = hs.add_parser("accuracy", help="teacher-forced top-1 of a head's drafted tokens per Spec-Bench category",
                       description="Score EAGLE/EAGLE-3 heads on the target's own greedy text: the top-1 of the "
                                   "first, second and third drafted token, per Spec-Bench dev category and on "
                                   "HumanEval's held-apart problems (the target's text is kept in the model cache "
                                   "for the next run). --save writes a report that `leapdecode results` shows.")
    add_model_args(ac)
    ac.add_argument("--head", action="append", default=[], metavar="DIR",
                    help="a head directory, or 'bundled' (repeat to compare heads; default: the one the store finds)")
    ac.add_argument("--per-category", type=int, default=2, help="Spec-Bench dev prompts per category (default: 2)")
    ac.add_argument("--humaneval", type=int, default=8, help="HumanEval held-apart problems (default: 8)")
    ac.add_argument("--tokens", type=int, default=96, help="the target's greedy tokens per prompt (default: 96)")
    ac.add_argument("--json", action="store_true", help="print the report as JSON")
    ac.add_argument("--save", default=None, metavar="FILE", help="also write the report (JSON) to FILE")
    ac.set_defaults(func=cmd_heads_accuracy)
    h.set_defaults(func=lambda a: (h.print_help(), 2)[1])
    return t


def _check(a: argparse.Namespace) -> None:
    from ..errors import InvalidParameterError

    for name in ("steps", "max_prompts", "gen_tokens", "seq_len", "batch", "medusa_heads", "val_tokens", "ttt_steps"):
        if getattr(a, name) < 1:
            raise InvalidParameterError(f"--{name.replace('_', '-')} must be >= 1")
    if a.resume and a.restart:
        raise InvalidParameterError("--resume goes on from the checkpoint, --restart deletes it: choose one")
    for name in ("eagle_intermediate", "train_vocab", "eval_per_category", "eval_humaneval", "text_chunks"):
        if getattr(a, name) < 0:
            raise InvalidParameterError(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("budget_minutes", "lr", "checkpoint_minutes"):
        if not getattr(a, name) > 0:
            raise InvalidParameterError(f"--{name.replace('_', '-')} must be > 0")


def cmd_train_head(a: argparse.Namespace) -> int:
    from ..cli_args import load_from_args
    from .data import check_sources
    from .train import Recipe, train_head

    _check(a)
    check_sources(a.data)  # before the model loads
    if a.threads > 0:
        import torch

        torch.set_num_threads(a.threads)
    recipe = Recipe(kind=a.kind, data=tuple(a.data), max_prompts=a.max_prompts, gen_tokens=a.gen_tokens,
                    text_chunks=a.text_chunks, seq_len=a.seq_len, steps=a.steps, budget_minutes=a.budget_minutes,
                    batch=a.batch, lr=a.lr, medusa_heads=a.medusa_heads, val_prompts=a.val_prompts,
                    eagle_intermediate=a.eagle_intermediate, train_vocab=a.train_vocab, ttt_steps=a.ttt_steps,
                    eagle_layers=tuple(a.eagle_layers) if a.eagle_layers else None,
                    val_tokens=a.val_tokens, checkpoint_minutes=a.checkpoint_minutes, seed=a.seed, init=a.init,
                    eval_per_category=a.eval_per_category, eval_humaneval=a.eval_humaneval)
    if a.out is not None:
        check_output(a.out, "--out", directory=True)  # before the model loads and the data is generated
    target = load_from_args(a)
    manifest = train_head(target, recipe, a.out, resume=a.resume, restart=a.restart, progress=not a.no_progress,
                          install_head=not a.no_install, command=_command())
    top1 = {k: v["top1"] for k, v in ((manifest.get("accuracy") or {}).get("sets") or {}).items()}
    print(json.dumps({**{k: manifest[k] for k in ("kind", "path", "steps", "acceptance", "data") if k in manifest},
                      "top1": top1}))
    return 0


def _command() -> str:
    return "leapdecode " + " ".join(shlex.quote(x) for x in sys.argv[1:]) if sys.argv[1:] else ""


def cmd_heads_accuracy(a: argparse.Namespace) -> int:
    import platform
    import time

    from ..cli_args import load_from_args
    from ..core.cost_model import machine_description
    from ..models.kernel_library import isa_flags
    from ..errors import InvalidParameterError
    from ..results.page import head_table
    from .accuracy import accuracy
    from .train import ProgressBars
    from ..proposers.heads.store import bundled_root, load_head

    for name in ("per_category", "humaneval"):
        if getattr(a, name) < 0:
            raise InvalidParameterError(f"--{name.replace('_', '-')} must be >= 0")
    if a.tokens < 1 or not (a.per_category or a.humaneval):
        raise InvalidParameterError("--tokens must be >= 1, and --per-category or --humaneval above 0")
    if a.save is not None:
        check_output(a.save, "--save", directory=False)
    target = load_from_args(a)
    results, heads = {}, {}
    bars = ProgressBars(True)  # (the target's text, once: later heads and runs read it from the cache)
    for spec in a.head or [None]:
        path = bundled_root() if spec == "bundled" else spec
        head, manifest = load_head(("eagle3", "eagle"), target, path)
        label = spec or "the store's head"
        try:
            res = accuracy(target, head, per_category=a.per_category, humaneval=a.humaneval, tokens=a.tokens,
                           progress=bars.task)
        finally:
            bars.close()
        results[label] = res["sets"]
        heads[label] = {"kind": manifest.get("kind"), "steps": manifest.get("steps"),
                        "created": manifest.get("created"), "notes": res["notes"]}
    report = {"report": "head-accuracy", "model": target.name, "heads": heads, "sets": results,
              "tokens_per_prompt": a.tokens, "per_category": a.per_category, "humaneval": a.humaneval,
              "machine": machine_description(target.model.device), "python": platform.python_version(),
              "cpu_flags": isa_flags() if target.model.device.type == "cpu" else None,
              "date": time.strftime("%Y-%m-%d"), "command": _command()}
    if a.save is not None:
        from ..proposers.heads.store import atomic_write

        atomic_write(Path(a.save), (json.dumps(report, indent=2) + "\n").encode())
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(head_table(results)))
        for label, h in heads.items():
            for note in h["notes"]:
                print(f"note ({label}): {note}")
    return 0


def cmd_heads_list(a: argparse.Namespace) -> int:
    from ..proposers.heads.store import heads_root, list_heads

    heads = list_heads()
    if a.json:
        print(json.dumps(heads, indent=2))
        return 0
    if not heads:
        print(f"no trained heads in {heads_root()} (train one: leapdecode train-head -m MODEL --kind eagle "
              "--out DIR)")
        return 0
    for h in heads:
        if "error" in h:
            print(f"{h['path']}: {h['error']}")
            continue
        acc = (h.get("acceptance") or {}).get("mean_accepted")
        print(f"{h['kind']:7} {h['target'].get('name', '?'):28} steps {h.get('steps', '?'):>6}  "
              f"accepted/forward {acc if acc is not None else '-':>7}  {h.get('storage') or '-':5}  "
              f"{'[bundled] ' if h.get('bundled') else ''}{h['path']}")
    return 0


def cmd_heads_export(a: argparse.Namespace) -> int:
    from ..proposers.heads.store import WEIGHTS, export_head

    out = export_head(a.src, check_output(a.out, "OUT_DIR", directory=True), a.storage)
    size = (out / WEIGHTS).stat().st_size
    print(f"{out}: {a.storage} head, {WEIGHTS} {size / 1e6:.2f} MB")
    return 0
