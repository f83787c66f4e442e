"""Building blocks of ``leapdecode train-dllm`` (docs/diffusion.md, "Training a small diffusion
LM"): turning an autoregressive model into a Dream-style diffusion LM, its training objective,
and ``train_dllm``, the loop behind ``leapdecode train-dllm`` (progress bar, atomic checkpoints,
resuming, a time budget; at the end the held-out masked-diffusion loss next to the AR parent's NLL).

- ``from_causal``: a native causal Llama/Qwen2 model (``models/native.py``) as a Dream-family
  ``DiffusionLM``, the way Dream and DiffuLLaMA start from an AR model: the same weights, one new
  vocabulary row for the mask token, **shifted** predictions (the output at ``i`` keeps predicting
  token ``i + 1``, what the AR model already does).  With a causal attention mask it computes the
  causal model's logits exactly (tested).
- ``annealed_mask``: DiffuLLaMA's attention-mask annealing ("Scaling Diffusion Language Models via
  Adaptation from Autoregressive Models", Gong et al., 2024): the causal mask is opened
  progressively, each query seeing a random growing fraction of the later keys, until the
  attention is fully bidirectional.
- ``masked_diffusion_loss``: the masked-diffusion objective of LLaDA ("Large Language Diffusion
  Models", Nie et al., 2025): draw t ~ U(eps, 1) per sequence, mask each token with probability
  t, cross-entropy on the masked tokens weighted by 1/t, averaged over all positions.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidParameterError
from ..models.architecture import ModelConfig
from .models import DiffusionConfig, DiffusionLM


def from_causal(causal: nn.Module, eos_token_ids: tuple[int, ...] = ()) -> DiffusionLM:
    """A Dream-family diffusion LM initialised from a float ``NativeCausalLM``; the mask token is
    a new id (the old vocabulary size) whose embedding starts at the mean embedding."""
    cfg: ModelConfig = causal.cfg
    layers = list(causal.layers)
    if not all(isinstance(getattr(b, n), nn.Linear) for b in layers for n in ("wqkv", "wo", "w_gate_up", "w_down")):
        raise InvalidParameterError("from_causal needs float weights (load the model with weights='fp32' or 'bf16')")
    vocab = cfg.vocab_size + 1
    base = ModelConfig(vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       max_position_embeddings=causal.max_seq_len, rope_theta=cfg.rope_theta,
                       rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False, attention_bias=True,
                       rope_scaling=cfg.rope_scaling)
    dcfg = DiffusionConfig("dream", base, mask_token_id=cfg.vocab_size, shift=True, eos_token_ids=eos_token_ids)
    net = DiffusionLM(dcfg)
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    with torch.no_grad():
        emb = causal.embed.weight.float()
        net.embed.weight.copy_(torch.cat([emb, emb.mean(0, keepdim=True)]))
        head = causal.head_weight.float()
        net.head.weight.copy_(torch.cat([head, torch.zeros(1, head.shape[1])]))
        net.norm.copy_(causal.norm.float())
        for src, dst in zip(layers, net.blocks):
            q, k, v = src.wqkv.weight.float().split((q_out, kv_out, kv_out))
            dst.q.weight.copy_(q)
            dst.k.weight.copy_(k)
            dst.v.weight.copy_(v)
            if src.wqkv.bias is not None:
                qb, kb, vb = src.wqkv.bias.float().split((q_out, kv_out, kv_out))
                dst.q.bias.copy_(qb)
                dst.k.bias.copy_(kb)
                dst.v.bias.copy_(vb)
            else:
                for lin in (dst.q, dst.k, dst.v):
                    lin.bias.zero_()
            dst.o.weight.copy_(src.wo.weight.float())
            gate, up = src.w_gate_up.weight.float().chunk(2)
            dst.gate.weight.copy_(gate)
            dst.up.weight.copy_(up)
            dst.down.weight.copy_(src.w_down.weight.float())
            dst.attn_norm.copy_(src.attn_norm.float())
            dst.mlp_norm.copy_(src.mlp_norm.float())
    return net.to(causal.embed.weight.device).reset_rope()


def annealed_mask(length: int, progress: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """A bool ``[length, length]`` attention mask: causal at ``progress`` 0, each later key visible
    with probability ``progress`` in between, fully bidirectional at 1."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if progress >= 1:
        return torch.ones_like(causal)
    opened = torch.rand(length, length, generator=generator) < max(progress, 0.0)
    return causal | opened


def masked_diffusion_loss(net: DiffusionLM, ids: torch.Tensor, eps: float = 1e-3,
                          generator: torch.Generator | None = None, attn_mask: torch.Tensor | None = None,
                          loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """LLaDA's objective on a batch ``ids`` ([B, L]); ``loss_mask``: positions that may be masked
    (e.g. not the prompt, for SFT).  Predictions are realigned first, so a shifted model learns to
    predict token ``i`` at the output of ``i - 1``."""
    b, length = ids.shape
    t = torch.rand(b, 1, generator=generator) * (1 - eps) + eps
    masked = torch.rand(b, length, generator=generator) < t
    if loss_mask is not None:
        masked &= loss_mask
    noisy = torch.where(masked, torch.full_like(ids, net.mask_token_id), ids)
    logits = net.realign(net(noisy, attn_mask=attn_mask))
    ce = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")  # [B, L]
    return (ce * masked / t).sum() / (b * length)


# ------------------------------------------------------------------ the train-dllm loop
def stdlib_files() -> list:
    """The Python standard library's sources (text that installs offline), sorted."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def token_chunks(tokenizer, files: list, seq_len: int, max_tokens: int, eos_id: int | None) -> torch.Tensor:
    """``[N, seq_len]`` token ids of the files' text, each file followed by EOS, cut into chunks."""
    ids: list[int] = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos_id is not None:
            ids.append(eos_id)
        if len(ids) >= max_tokens:
            break
    n = min(len(ids), max_tokens) // seq_len
    if n < 2:
        raise InvalidParameterError(f"too little text for training: {len(ids)} tokens, need 2 chunks of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


TRAINER_FILE = "trainer.pt"
STATE_FILE = "train_state.json"


def format_seconds(s: float) -> str:
    s = max(0, int(round(s)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def progress_line(step: int, loss: float, tokens_per_s: float, elapsed: float, budget: float | None,
                  max_steps: int | None, mask_open: float, loss_mean: float | None = None) -> str:
    """The progress bar's text: steps, the last loss (and its 10-step mean), tokens/s and the time
    left against the budget (or, with ``max_steps``, the steps left at the current speed)."""
    if max_steps is not None:
        eta = (max_steps - step) * elapsed / max(step, 1)
        where = f"step {step}/{max_steps}"
    else:
        eta = max(0.0, (budget or 0.0) - elapsed)
        where = f"step {step}"
    mean = f" (mean of 10: {loss_mean:.3f})" if loss_mean is not None else ""
    return (f"{where} loss {loss:.3f}{mean} {tokens_per_s:,.0f} tok/s mask-open {mask_open:.2f} "
            f"{format_seconds(elapsed)} elapsed, ETA {format_seconds(eta)}")


def write_checkpoint_atomically(out, write) -> None:
    """``write(tmp_dir)`` fills a temporary sibling directory, which then replaces ``out``: an
    interruption at any point leaves either the old checkpoint or the new one (a crash between the
    two renames leaves ``out.old``, which ``resume_dir`` picks up)."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the checkpoint from other users
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def resume_dir(out):
    """The checkpoint directory to resume from: ``out`` when it holds a train-dllm state, else
    ``out.old`` (a crash between the two renames of a checkpoint), else None."""
    from pathlib import Path

    out = Path(out)
    for d in (out, out.with_name(out.name + ".old")):
        if (d / STATE_FILE).is_file() and (d / TRAINER_FILE).is_file():
            return d
    return None


def held_out_nll_of_parent(parent, held: torch.Tensor, batch_size: int) -> float:
    """The AR parent's mean next-token NLL (nats/token) on ``held`` (full causal forwards)."""
    model = parent.model
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, held.shape[0], batch_size):
            rows = held[i : i + batch_size]
            logits = model.forward(rows, model.new_cache(batch_size=rows.shape[0], max_len=rows.shape[1]))
            total += float(F.cross_entropy(logits[:, :-1].float().transpose(1, 2), rows[:, 1:], reduction="sum"))
            count += rows[:, 1:].numel()
    return total / max(count, 1)


def train_dllm(parent, chunks: torch.Tensor, out, *, minutes: float = 30.0, max_steps: int | None = None,
               batch_size: int = 8, lr: float = 1e-4, warmup: int = 50, anneal: float = 0.3, seed: int = 0,
               checkpoint_minutes: float = 5.0, progress: bool = True, eval_chunks: int = 32,
               fresh: bool = False, on_step=None) -> dict:
    """Adapt ``parent`` (a float ``LoadedModel`` of the native backend) into a Dream-style diffusion
    LM on ``chunks`` for ``minutes`` of training time (or ``max_steps``), writing a checkpoint
    directory ``out`` (config.json, model.safetensors, tokenizer, train_state.json, trainer.pt with
    the optimiser and random state) every ``checkpoint_minutes`` and at the end, each time through a
    temporary directory renamed into place.  The attention mask anneals from causal to full over the
    first ``anneal`` of the run.

    Resuming: when ``out`` already holds a checkpoint of this run (same parent, data shape and
    settings), training continues from it (same weights, optimiser moments, random stream, step and
    training time), so an interrupted run restarted with the same command ends where an
    uninterrupted one would; a finished run is returned as is.  ``fresh=True`` starts over.  A
    KeyboardInterrupt writes a checkpoint before it propagates.  ``on_step(step)`` is called after
    each step (tests use it to interrupt a run).

    Returns the run's summary (also in train_state.json): steps, tokens, training seconds, the
    loss curve, and at the end the held-out masked-diffusion loss (an upper bound on the NLL per
    token) next to the AR parent's NLL on the same held-out chunks (``eval_chunks`` of the 5% never
    trained on)."""
    import json
    import time
    from pathlib import Path

    from tqdm import tqdm

    from .models import load_network, save_pretrained

    out = Path(out).expanduser()
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(chunks.shape[0], generator=g)
    n_held = max(1, chunks.shape[0] // 20)
    held, train = chunks[perm[:n_held]], chunks[perm[n_held:]]
    if train.shape[0] < 1:
        raise InvalidParameterError(f"too little text: {chunks.shape[0]} chunks leave none to train on")
    net = from_causal(parent.model, tuple(sorted(parent.eos_token_ids))).train()
    tok = parent.tokenizer
    if len(tok) == net.mask_token_id:
        tok.add_special_tokens({"mask_token": "<|mdm_mask|>"})
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    budget = minutes * 60.0
    settings = {"parent": parent.name, "seq_len": int(chunks.shape[1]), "chunks": int(chunks.shape[0]),
                "batch_size": batch_size, "lr": lr, "warmup": warmup, "anneal": anneal, "seed": seed,
                "minutes": minutes, "max_steps": max_steps}
    state: dict = {**settings, "steps": 0, "tokens": 0, "train_seconds": 0.0, "finished": False,
                   "train_chunks": int(train.shape[0]), "held_out_chunks": int(held.shape[0]), "sessions": 0,
                   "losses": []}
    src = None if fresh else resume_dir(out)
    if src is None and out.exists() and any(out.iterdir()) and not fresh:
        raise InvalidParameterError(f"{out} exists and is not a train-dllm checkpoint: choose another --out")
    if src is not None:
        old = json.loads((src / STATE_FILE).read_text())
        differ = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if differ:
            raise InvalidParameterError(f"{out} holds a run with other settings {differ}: resume with the same "
                                        f"command, or pass --fresh to start over")
        state = old
        if state.get("finished"):
            return state
        trained = load_network(src)
        with torch.no_grad():
            for p_ours, p_saved in zip(net.parameters(), trained.parameters(), strict=True):
                p_ours.copy_(p_saved)
        del trained
        saved = torch.load(src / TRAINER_FILE, weights_only=False)
        opt.load_state_dict(saved["optimizer"])
        g.set_state(saved["generator"])
    state["sessions"] = int(state.get("sessions", 0)) + 1
    losses: list[float] = state["losses"]

    def write(d: Path) -> None:
        save_pretrained(net, d)
        tok.save_pretrained(str(d))
        torch.save({"optimizer": opt.state_dict(), "generator": g.get_state()}, d / TRAINER_FILE)
        (d / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")

    def save() -> None:
        write_checkpoint_atomically(out, write)

    tty = progress and sys.stderr.isatty()
    bar = tqdm(total=max_steps if max_steps is not None else round(budget), disable=not progress,
               unit="step" if max_steps is not None else "s", mininterval=0.5 if tty else 30.0,
               bar_format="train-dllm {percentage:3.0f}%|{bar}| {desc}", file=sys.stderr)
    step = int(state["steps"])
    prior = float(state["train_seconds"])
    session_t0 = last_ckpt = time.perf_counter()
    session_tokens = 0
    last_print = session_t0
    try:
        while True:
            elapsed = prior + time.perf_counter() - session_t0
            if (max_steps is not None and step >= max_steps) or (max_steps is None and elapsed >= budget):
                state["train_seconds"] = elapsed  # with the last checkpoint's writing
                break
            frac = step / max_steps if max_steps else elapsed / budget
            opened = min(1.0, frac / anneal) if anneal > 0 else 1.0
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / max(warmup, 1))
            batch = train[torch.randint(0, train.shape[0], (batch_size,), generator=g)]
            mask = annealed_mask(batch.shape[1], opened, g)
            loss = masked_diffusion_loss(net, batch, generator=g, attn_mask=mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            step += 1
            losses.append(round(float(loss.detach()), 5))
            session_tokens += int(batch.numel())
            now = time.perf_counter()
            state["steps"], state["tokens"] = step, state["tokens"] + int(batch.numel())
            state["train_seconds"] = prior + now - session_t0
            if progress:
                bar.n = step if max_steps is not None else min(round(budget), round(state["train_seconds"]))
                bar.set_description_str(progress_line(step, losses[-1], session_tokens / (now - session_t0),
                                                  state["train_seconds"], budget, max_steps, opened,
                                                  sum(losses[-10:]) / len(losses[-10:])), refresh=False)
                if tty or now - last_print >= 30 or step == 1:  # a log file gets a line every 30 s
                    bar.refresh()
                    last_print = now
            if on_step is not None:
                on_step(step)
            if now - last_ckpt >= checkpoint_minutes * 60:
                save()
                last_ckpt = time.perf_counter()
    except KeyboardInterrupt:
        bar.close()
        save()
        raise
    bar.close()
    net.eval()
    ev = held[:eval_chunks]
    with torch.no_grad():
        eval_g = torch.Generator().manual_seed(seed + 1)
        n_batches = (ev.shape[0] + batch_size - 1) // batch_size
        state["held_out_loss"] = float(sum(masked_diffusion_loss(net, ev[i : i + batch_size], generator=eval_g)
                                           for i in range(0, ev.shape[0], batch_size)) / n_batches)
    state["held_out_eval_chunks"] = int(ev.shape[0])
    state["parent_held_out_nll"] = held_out_nll_of_parent(parent, ev, batch_size)
    state["finished"] = True
    save()
    return state
