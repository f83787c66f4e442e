"""Training Medusa, Hydra, EAGLE and EAGLE-3 heads on the target's own features (``leapdecode train-head``).

Papers: "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (2024),
"Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding" (2024), "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty" (2024), "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test" (2025).

Data: ``training.data`` (HumanEval prompts and Magpie requests answered by the target itself,
teacher-forced text, an earlier run's token sequences), extracted through the target once and kept
as shards in the work directory that later runs add to.

Objectives.  Medusa head ``i`` at position ``t`` learns the target's greedy token at ``t + i + 1``
(cross-entropy through the frozen output head).  Hydra head ``i`` at ``t`` learns the same token from
``f_t`` and the embeddings of the text's tokens ``t + 1 .. t + i + 1`` (teacher forcing: on
self-distilled text they are the target's own greedy tokens, what a correct draft path holds).  EAGLE at position ``t`` reads ``(f_t, x_{t+1})`` and
learns ``f_{t+1}`` (smooth L1) plus the target's greedy token after it (cross-entropy, weight 0.1 on
the classification loss as in the paper), with uniform noise on the input features (EAGLE's
robustness to its own drafted features).  The output head is restricted to the ``train_vocab``
lowest ids during training (FR-Spec's subset; labels outside it are ignored) to keep the CPU cost
down on a 152k vocabulary.  EAGLE-3 reads the fused low, middle and high layer states (extracted
with the features) and is trained by EAGLE-3's training-time test: ``ttt_steps`` unrolled steps, step
``j`` feeding row ``i`` the head's own output of step ``j - 1`` at that row with the token ``j``
further on, attending to the exact context up to row ``i`` (step 0) and to its own row of the steps
before (as a drafted chain does at decoding); the token loss alone (no feature regression, no
input noise), step ``j`` weighted ``0.8 ** j``.

Steps that add up.  The work directory (``--out``; by default ``<cache>/train/<model>-<kind>``)
holds the data shards, ``checkpoint.pt`` (head, optimizer, step, elapsed time and every run's
record; written every ``checkpoint_minutes`` and at the end, atomically) and the head.  ``--resume``
goes on from the checkpoint with every shard plus this run's new data, for up to ``steps`` more
steps; ``--init`` starts a new head from a trained one (the bundled head, say) instead of random
weights; ``--restart`` deletes the checkpoint and the shards.  A step's batch is a function of the
step and the data, so a resumed run trains on what an uninterrupted one would have.  After every
run the head is scored (``training.accuracy``: teacher-forced top-1 of each drafted step per Spec-Bench
category and on HumanEval's held-apart problems) into the manifest and ``accuracy.json``.
"""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import accuracy as head_accuracy
from . import data as head_data
from ..results.page import DEV_SET, HUMANEVAL_SET
from ..errors import HeadMismatchError, InvalidParameterError
from ..models import store
from ..proposers.heads.common import fingerprint
from ..proposers.heads.eagle import Eagle3Head, EagleHead, default_layers, ttt_outputs
from ..proposers.heads.hydra import HydraHeads
from ..proposers.heads.medusa import MedusaHeads
from ..proposers.heads.store import (KIND_METHOD, KINDS, atomic_write, check_kind, install, load_head, model_slug,
                                    save_head)

CHECKPOINT = "checkpoint.pt"
ACCURACY = "accuracy.json"


@dataclass
class Recipe:
    kind: str
    data: tuple[str, ...] = ("humaneval", "stdlib")
    max_prompts: int = 64  # self-distillation prompts
    prompt_tokens: int = 256  # a prompt's last tokens kept
    gen_tokens: int = 128  # the target's greedy continuation per prompt
    text_chunks: int = 32  # teacher-forced sequences a run adds (text chunks, tokens: sequences)
    seq_len: int = 256  # tokens per training window
    steps: int = 2000
    budget_minutes: float = 30.0
    batch: int = 4  # windows per step
    lr: float = 3e-4
    medusa_heads: int = 4  # (also Hydra's head count)
    eagle_intermediate: int = 0  # the EAGLE layer's MLP width (0: the target's)
    eagle_layers: tuple[int, ...] | None = None  # EAGLE-3's fused hidden states (None: 2, N // 2, N - 3)
    ttt_steps: int = 3  # EAGLE-3's training-time test: unrolled steps
    train_vocab: int = 32768
    val_prompts: int = 8
    val_tokens: int = 64
    checkpoint_minutes: float = 5.0
    seed: int = 0
    init: str | None = None  # a trained head to start from ("bundled": the package's; else a directory)
    eval_per_category: int = 2  # Spec-Bench dev prompts per category scored after the run (EAGLE kinds)
    eval_humaneval: int = 8  # HumanEval held-apart problems scored after the run
    eval_tokens: int = 96  # the target's greedy tokens per scored prompt

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


# ------------------------------------------------------------------ data
def layers_for(target, recipe: Recipe) -> list[int]:
    """The hidden states the recipe's head reads besides the last layer's feature (EAGLE-3's)."""
    if recipe.kind != "eagle3":
        return []
    n = target.model.cfg.n_layers
    layers = default_layers(n) if recipe.eagle_layers is None else [int(x) for x in recipe.eagle_layers]
    if not layers or any(x < 0 or x > n for x in layers):
        raise InvalidParameterError(f"--eagle-layers {layers}: hidden-state indices 0..{n} (0: the embedding "
                                    f"output, i: layer i's output) of {target.name}")
    return layers


# ------------------------------------------------------------------ losses
def _logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    labels = torch.where(labels < logits.shape[-1], labels, torch.full_like(labels, -100))
    if bool((labels < 0).all()):
        return logits.sum() * 0.0
    return F.cross_entropy(logits, labels, ignore_index=-100)


def medusa_loss(head: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Head ``i`` at position ``t``: the target's greedy token at ``t + i + 1`` (``labels[t + i + 1]``)."""
    states = head(feats)  # [heads, T, H]
    total = feats.new_zeros(())
    n = 0
    for i in range(states.shape[0]):
        m = feats.shape[0] - (i + 1)
        if m < 1:
            break
        total = total + _ce(_logits(states[i, :m], weight), labels[i + 1 :])
        n += 1
    return total / max(n, 1)


def hydra_loss(head: HydraHeads, feats: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
               weight: torch.Tensor, embed: torch.nn.Embedding) -> torch.Tensor:
    """Head ``i`` at ``t``: from ``f_t`` and the embeddings of ``x_{t+1} .. x_{t+i+1}``, the target's
    greedy token at ``t + i + 1`` (``labels[t + i + 1]``)."""
    with torch.no_grad():
        emb = embed(tokens.to(embed.weight.device)).float()
    total = feats.new_zeros(())
    n = 0
    for i in range(head.n_heads):
        m = feats.shape[0] - (i + 1)
        if m < 1:
            break
        window = torch.stack([emb[1 + j : 1 + j + m] for j in range(i + 1)], 1)  # [m, i + 1, H]
        total = total + _ce(_logits(head(i, feats[:m], window), weight), labels[i + 1 :])
        n += 1
    return total / max(n, 1)


def eagle_loss(head: EagleHead, feats: torch.Tensor | None, tokens: torch.Tensor, labels: torch.Tensor,
               weight: torch.Tensor, embed: torch.nn.Embedding, noise: float = 0.1,
               generator: torch.Generator | None = None, ttt_steps: int = 1,
               states: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE at ``t``: ``(f_t, x_{t+1}) -> f_{t+1}`` (smooth L1) and the target's greedy token after
    ``t + 1`` (cross-entropy, weight 0.1).  EAGLE-3 (an ``Eagle3Head``, ``states``: the fused layers'
    hidden states): the fused feature in, the token loss alone, over ``ttt_steps`` unrolled steps
    of training-time test (module docstring).  ``segments`` (non-decreasing window ids, one per
    row): several windows side by side in one call, none attending to another, positions counted
    from each window's start, and no row trained on a label from the next window; with windows of
    equal length the loss is the mean of their separate losses (tests/test_eagle3.py)."""
    v3 = isinstance(head, Eagle3Head)
    if v3 and states is None:
        raise InvalidParameterError("an eagle3 head trains on the fused layers' hidden states")
    rows = states if v3 else feats  # (EAGLE-3 reads no final feature: ``feats`` may be None)
    t = rows.shape[0] - 1
    if t < 1:
        return rows.sum() * 0.0
    if v3:
        inp = head.fuse_states(states[:t])
    else:
        inp = feats[:t]
        if noise:
            inp = inp + ((torch.rand(inp.shape, generator=generator) * 2 - 1) * noise).to(inp.device)
    with torch.no_grad():
        emb = embed(tokens.to(embed.weight.device)).float()
        emb = torch.cat([emb, emb.new_zeros(max(ttt_steps, 1), emb.shape[-1])])  # rows past the end: masked out
    outs = ttt_outputs(head, inp, emb, min(max(ttt_steps, 1), t), None if segments is None else segments[:t])

    def targets(j: int, m: int) -> torch.Tensor:  # rows 0 .. m - 1: the label j + 1 tokens on, -100 across windows
        lab = labels[1 + j : 1 + j + m]
        if segments is None:
            return lab
        return torch.where(segments[1 + j : 1 + j + m] == segments[:m], lab, torch.full_like(lab, -100))

    lab0 = targets(0, t)
    ce = _ce(_logits(head.readout(outs[0]), weight), lab0)
    if v3:
        loss = ce
    elif segments is None:
        loss = F.smooth_l1_loss(outs[0], feats[1 : t + 1]) + 0.1 * ce
    else:  # not the rows whose next feature is in the next window
        keep = lab0 != -100
        loss = F.smooth_l1_loss(outs[0][keep], feats[1 : t + 1][keep]) + 0.1 * ce
    for j in range(1, len(outs)):
        m = t - j  # rows 0 .. m - 1 have a label j tokens further on
        loss = loss + (0.8 ** j) * _ce(_logits(head.readout(outs[j][:m]), weight), targets(j, m))
    return loss


# ------------------------------------------------------------------ training
def optimizer_step(head: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """One optimizer step on ``loss`` with the gradient norm clipped at 1 (every head's recipe, also
    scripts/head_gpu.py's); returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def _save_torch(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getvalue())


def new_head(kind: str, target, recipe: Recipe) -> torch.nn.Module:
    """A head of ``kind`` for ``target``: random weights, or ``recipe.init``'s (a trained head of that
    kind for that target: "bundled" names the package's, anything else a directory)."""
    if recipe.init:
        from ..proposers.heads.store import bundled_root

        path = bundled_root() if recipe.init == "bundled" else Path(recipe.init).expanduser()
        head, _ = load_head(kind, target, path)
        head.requires_grad_(True)
        if kind == "eagle3" and list(head.config.get("layers") or []) != layers_for(target, recipe):
            raise InvalidParameterError(f"--init {recipe.init}: its head fuses layers {head.config.get('layers')}, "
                                        f"not {layers_for(target, recipe)} (pass --eagle-layers to match)")
        return head
    torch.manual_seed(recipe.seed)
    if kind == "medusa":
        return MedusaHeads.for_target(target, heads=recipe.medusa_heads)
    if kind == "hydra":
        return HydraHeads.for_target(target, heads=recipe.medusa_heads)
    if kind == "eagle3":
        return Eagle3Head.for_target(target, intermediate=recipe.eagle_intermediate or None,
                                     layers=layers_for(target, recipe))
    return EagleHead.for_target(target, intermediate=recipe.eagle_intermediate or None)


def default_workdir(target, kind: str) -> Path:
    """Where ``train-head`` keeps a model's training of ``kind`` without ``--out``: the model cache's
    ``train/<model>-<kind>``."""
    return store.cache_dir() / "train" / f"{model_slug(target.name)}-{check_kind(kind)}"


def train_head(target, recipe: Recipe, out: str | Path | None = None, *, resume: bool = False,
               restart: bool = False, progress: bool = True, install_head: bool = True, command: str = "",
               log: Callable[[str], None] | None = None) -> dict:
    """Train ``recipe.kind``'s head for ``target`` in the work directory ``out`` (default:
    ``default_workdir``), adding ``recipe.data``'s new sequences to its shards; ``resume`` goes on
    from its checkpoint, ``restart`` deletes checkpoint and shards first.  Returns the manifest (also
    in ``out/manifest.json``, and installed into the store unless ``install_head`` is False)."""
    kind = check_kind(recipe.kind)
    log = log or (lambda msg: print(f"leapdecode: {msg}", file=sys.stderr, flush=True))
    if getattr(target, "backend", None) != "native":
        raise InvalidParameterError("train-head needs the native backend (features and output head of the target)")
    layers_for(target, recipe)  # before any data is generated (probe T07: --eagle-layers 999 was refused minutes later)
    head_data.check_sources(recipe.data)
    out = Path(out) if out is not None else default_workdir(target, kind)
    ckpt_path = out / CHECKPOINT
    if restart:
        ckpt_path.unlink(missing_ok=True)
    elif ckpt_path.exists() and not resume:
        raise InvalidParameterError(f"{out} holds a checkpoint: --resume goes on from it (with this run's new data), "
                                    "--restart deletes it and the data, or choose another --out")
    elif resume and not ckpt_path.exists():
        raise InvalidParameterError(f"--resume: {out} holds no checkpoint (drop --resume to start one)")
    if resume and recipe.init:
        raise InvalidParameterError("--init starts a new head; --resume goes on with the checkpoint's: choose one")
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(target)
    t_start = time.perf_counter()
    bar = ProgressBars(progress)
    try:
        return _train(target, recipe, kind, out, fp, t_start, bar, restart, install_head, command, log)
    finally:
        bar.close()


def _train(target, recipe, kind, out, fp, t_start, bar, restart, install_head, command, log) -> dict:
    budget_s = recipe.budget_minutes * 60.0
    # ---- data: this run's new sequences join the shards, training reads them all
    shards = head_data.Shards(out, fp, layers_for(target, recipe), keep_feats=kind != "eagle3", log=log)
    if restart:
        shards.clear()
    held = shards.keys()
    items, heldout, described = head_data.plan(target, recipe.data, held=held, max_prompts=recipe.max_prompts,
                                                text_chunks=recipe.text_chunks, seq_len=recipe.seq_len,
                                                seed=recipe.seed)
    if held:
        log(f"{len(held)} sequences in {shards.dir}; this run adds {len(items)}")
    added = head_data.extract(target, items, shards, prompt_tokens=recipe.prompt_tokens, gen_tokens=recipe.gen_tokens,
                               seed=recipe.seed, progress=bar.task)
    data = shards.load()
    if not data.tokens:
        raise InvalidParameterError(f"--data {' '.join(recipe.data)} gave no training text")
    log(f"training data: {len(data.tokens)} sequences, {data.n_tokens} tokens in {len(shards.paths())} shards "
        f"(this run: {added['added_tokens']} tokens; features at {added['feature_tokens_per_s']} tokens/s, "
        f"generation at {added['generated_tokens_per_s']} tokens/s)")
    tok = target.tokenizer
    data.heldout = [tok.encode(p)[-recipe.prompt_tokens:] for p in heldout[: recipe.val_prompts]]
    data.description = {"sources": described, "sequences": len(data.tokens), "tokens": data.n_tokens,
                        "shards": len(shards.paths()), "heldout_prompts": len(data.heldout), "this_run": added}

    # ---- the head, the optimizer, and the step to start from
    dev = target.model.device  # train where the target runs (a GPU when there is one)
    step, trained_s, history = 0, 0.0, []
    ckpt_path = out / CHECKPOINT
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        if ckpt.get("kind") != kind or ckpt.get("fingerprint") != fp:
            raise HeadMismatchError(f"{ckpt_path} is a {ckpt.get('kind')} checkpoint for another model or kind; "
                                    "use another --out or --restart")
        head = KINDS[kind].from_config(ckpt["config"]).float().to(dev).train()
        head.load_state_dict(ckpt["head"])
        opt = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.0)
        opt.load_state_dict(ckpt["opt"])
        step, trained_s, history = int(ckpt["step"]), float(ckpt["trained_s"]), list(ckpt.get("history") or [])
        log(f"resuming from step {step} ({ckpt_path})")
    else:
        head = new_head(kind, target, recipe).float().to(dev).train()
        opt = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.0)

    weight = target.model.head_weight.detach()
    vocab = min(int(weight.shape[0]), recipe.train_vocab) if recipe.train_vocab else int(weight.shape[0])
    weight = weight[:vocab].float().to(dev)
    embed = target.model.embed
    first_step = step

    def checkpoint() -> None:
        _save_torch(ckpt_path, {"kind": kind, "fingerprint": fp, "config": head.config, "step": step,
                                "trained_s": trained_s, "head": head.state_dict(), "opt": opt.state_dict(),
                                "history": history})

    last_ckpt = time.perf_counter()
    n_seq = len(data.tokens)
    losses: list[float] = []
    trained_tokens = 0
    advance = bar.task(f"training {kind}", recipe.steps)
    t_loop = time.perf_counter()
    base_trained = trained_s
    while step - first_step < recipe.steps and time.perf_counter() - t_start < budget_s:
        g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step)
        loss = torch.zeros((), device=dev)
        for _ in range(recipe.batch):
            i = int(torch.randint(n_seq, (), generator=g))
            toks, labels = data.tokens[i], data.labels[i].to(dev)
            s = int(torch.randint(max(1, toks.numel() - recipe.seq_len + 1), (), generator=g))
            sl = slice(s, s + recipe.seq_len)
            trained_tokens += len(toks[sl])
            feats = data.feats[i][sl].to(dev).float() if data.feats[i] is not None else None
            if kind == "medusa":
                loss = loss + medusa_loss(head, feats, labels[sl], weight)
            elif kind == "hydra":
                loss = loss + hydra_loss(head, feats, toks[sl], labels[sl], weight, embed)
            elif kind == "eagle3":
                states = data.layer_feats[i][sl].to(dev).float()
                loss = loss + eagle_loss(head, feats, toks[sl], labels[sl], weight, embed, generator=g,
                                         ttt_steps=recipe.ttt_steps, states=states)
            else:
                loss = loss + eagle_loss(head, feats, toks[sl], labels[sl], weight, embed, generator=g)
        losses.append(optimizer_step(head, opt, loss / recipe.batch))
        step += 1
        trained_s = base_trained + time.perf_counter() - t_loop
        advance()
        if time.perf_counter() - last_ckpt >= recipe.checkpoint_minutes * 60.0:
            checkpoint()
            last_ckpt = time.perf_counter()
    run_s = time.perf_counter() - t_loop
    trained_s = base_trained + run_s

    # ---- the head, its validation and accuracy, the manifest
    head.eval()
    accuracy = None
    if kind in ("eagle", "eagle3") and (recipe.eval_per_category or recipe.eval_humaneval):
        accuracy = head_accuracy.accuracy(target, head, per_category=recipe.eval_per_category,
                                       humaneval=recipe.eval_humaneval, tokens=recipe.eval_tokens, progress=bar.task)
        _write_json(out / ACCURACY, accuracy)
    bar.close()  # (the validation prints no bars)
    run = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": [first_step, step],
           "train_seconds": round(run_s, 2),
           "trained_tokens_per_s": round(trained_tokens / run_s, 1) if run_s else None,
           "data": added, "device": str(dev), "command": command,
           "top1": {k: v["top1"] for k, v in (accuracy or {}).get("sets", {}).items()
                    if k in (DEV_SET, HUMANEVAL_SET)}}
    history.append(run)
    checkpoint()
    manifest = {"target": {"name": target.name, "fingerprint": fp}, "data": data.description,
                "steps": step, "train_seconds": round(trained_s, 2), "recipe": recipe.describe(),
                "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 5) if losses else None,
                "acceptance": None, "accuracy": accuracy, "runs": history, "command": command,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    save_head(out, head, manifest)  # (beside its shards and checkpoint: ``options head=OUT`` decodes with it)
    manifest["acceptance"] = validate(target, kind, out, data.heldout, recipe.val_tokens)
    save_head(out, head, manifest)
    if install_head:
        manifest["installed"] = str(install(out, target))
    dev_top1 = ((accuracy or {}).get("sets", {}).get(DEV_SET) or {}).get("top1")
    log(f"{kind} head: steps {first_step} -> {step} ({run_s:.1f} s, {run['trained_tokens_per_s']} tokens/s); "
        f"held-apart acceptance {manifest['acceptance']}; Spec-Bench dev top-1 per step {dev_top1}; "
        f"head in {out}")
    return {"format": 1, "kind": kind, "config": head.config, "path": str(out), **manifest}


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=2) + "\n").encode())


def validate(target, kind: str, head_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> dict | None:
    """Greedy decoding of the held-apart prompts with the head: mean accepted tokens per target
    forward (new tokens / target forwards), over all of them."""
    from ..api import generate
    from ..core.runner import ModelRunner

    if not prompts:
        return None
    runner = ModelRunner(target)  # its own memory: the head just written, not one loaded before
    new = forwards = 0
    for ids in prompts:
        res = generate(runner, prompt_ids=ids, method=KIND_METHOD[kind], options={"head": str(head_dir)},
                       max_new_tokens=max_new_tokens)
        new += res.stats["new_tokens"]
        forwards += res.stats["target_forwards"]
    return {"mean_accepted": round(new / forwards, 4) if forwards else 0.0, "prompts": len(prompts),
            "new_tokens": new, "target_forwards": forwards, "max_new_tokens": max_new_tokens}


class ProgressBars:
    """rich progress bars on stderr (off when disabled or not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            console = Console(stderr=True)
            if console.is_terminal:
                self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TimeRemainingColumn(), console=console)
                self.bar.start()

    def task(self, description: str, total: int, done: int = 0) -> Callable[[], None]:
        if self.bar is None:
            return lambda: None
        t = self.bar.add_task(description, total=total, completed=done)
        return lambda: self.bar.advance(t)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
