"""Self-distil and train an EAGLE-3 (or EAGLE) draft head for a GGUF target on one CUDA GPU,
inside a fixed wall-clock budget (docs/heads.md, "A head trained on a GPU").

`leapdecode train-head` is the supported command and runs anywhere; this script is the recipe
for the few minutes of a borrowed GPU, where generating the training text one prompt at a time
would waste the card.  It reads the target from its GGUF with transformers' GGUF loader (bf16 on
the GPU) and, all under one deadline:

1. writes extra prompts Magpie-style: the chat template's opening of a user turn, sampled, so the
   instruct target writes the requests itself ("Magpie: Alignment Data Synthesis from Scratch by
   Prompting Aligned LLMs with Nothing", Xu et al., 2024);
2. answers every prompt greedily in large left-padded batches (self-distillation, as Medusa-2
   and EAGLE recommend); prompts with a follow-up (`"then"`, `head_prompt_mix.py`) get a second
   round built from their first answer;
3. runs every sequence once more with hidden states: the feature after the final norm, the
   target's greedy token at every position (the labels) and, for EAGLE-3, the chosen layers'
   hidden states (indices as in `Eagle3Head`: 0 the embedding output, `i` layer `i`'s output);
4. trains the head with leapdecode's own losses (`leapdecode.training.train.eagle_loss`: EAGLE-3's
   training-time test, or EAGLE's feature regression) on windows drawn in proportion to length,
   AdamW with warm-up and a cosine decay over the time left, a few sequences held apart for
   the top-1 accuracy of each unrolled step.

Outputs in `--out` (checkpointed every `--save-every` seconds, so a run stopped at its limit
still leaves its last head): `head-N.safetensors` (the head in bf16, split into files of at most
15 MB), `head.json` (config, data, timings, accuracies) and `tokens.npz` (every training
sequence's token ids, for later runs).  `scripts/head_from_gpu.py` turns them into a leapdecode
head (manifest, fingerprint, validation) on the machine that runs the target.

    python scripts/head_gpu.py --gguf-parts .gpu --prompts .gpu/prompts.jsonl.gz --minutes 7 --out $OUT

A later run can go on from a head (`--init`, e.g. the bundled one) and reuse an earlier run's
sequences (`--tokens`, their held-apart sequences stay held apart), spending its minutes on new
prompts (`head_prompt_mix.py --general N`) and training.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from leapdecode.training.data import user_turn_prefix  # noqa: E402
from leapdecode.training.accuracy import chain_hits  # noqa: E402
from leapdecode.training.train import eagle_loss, optimizer_step  # noqa: E402
from leapdecode.models.registry import DEFAULT_MODEL, get_entry  # noqa: E402
from leapdecode.proposers.heads.eagle import Eagle3Head, EagleHead, default_layers  # noqa: E402
from leapdecode.proposers.heads.store import read_head  # noqa: E402



def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def assemble(parts_dir: Path, dest: Path, sha256: str | None) -> Path:
    parts = sorted(parts_dir.glob("part*"))
    if not parts:
        raise SystemExit(f"no part* files in {parts_dir}")
    h = hashlib.sha256()
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
                    out.write(chunk)
    if sha256 and h.hexdigest() != sha256:
        tmp.unlink()
        raise SystemExit(f"assembled GGUF sha256 {h.hexdigest()} != {sha256} ({len(parts)} parts)")
    os.replace(tmp, dest)
    return dest


def chat_ids(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


@torch.no_grad()
def generate(model, prompts: list[list[int]], new_tokens: int, batch: int, deadline: float,
             eos: list[int], pad: int, sample: bool = False) -> list[list[int] | None]:
    """Each prompt's continuation (greedy unless ``sample``), cut after the first end token; None for
    prompts the deadline left out.  Batches of similar length, left-padded."""
    dev = model.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    groups = [order[s : s + batch] for s in range(0, len(order), batch)]
    random.Random(0).shuffle(groups)  # (a deadline then cuts a mix of lengths)
    for g in groups:
        if time.time() > deadline:
            break
        width = max(len(prompts[i]) for i in g)
        ids = torch.full((len(g), width), pad, dtype=torch.long)
        mask = torch.zeros((len(g), width), dtype=torch.long)
        for r, i in enumerate(g):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        kw = dict(do_sample=True, temperature=1.0, top_p=0.995, top_k=0) if sample else dict(do_sample=False)
        res = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new_tokens,
                             eos_token_id=eos, pad_token_id=pad, **kw).cpu()
        for r, i in enumerate(g):
            cont = res[r, width:].tolist()
            cut = next((j for j, t in enumerate(cont) if t in eos), None)
            out[i] = cont if cut is None else cont[: cut + 1]
    return out


@torch.no_grad()
def features(model, seqs: list[list[int]], layers: list[int] | None, batch_tokens: int):
    """(feats bf16 [T, H], labels [T], states bf16 [T, len(layers) * H] or None) per sequence, on the GPU."""
    dev = model.device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res: list = [None] * len(seqs)
    s = 0
    checked = False
    while s < len(order):
        e = s
        while e < len(order) and len(seqs[order[e]]) * (e - s + 1) <= batch_tokens:
            e += 1
        e = max(e, s + 1)
        g = order[s:e]
        width = max(len(seqs[i]) for i in g)
        ids = torch.zeros((len(g), width), dtype=torch.long)
        mask = torch.zeros((len(g), width), dtype=torch.long)
        for r, i in enumerate(g):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        out = model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=layers is not None)
        last = out.last_hidden_state
        labels = model.lm_head(last).argmax(-1)
        if layers is not None:
            hs = out.hidden_states
            if not checked:  # hidden_states[0] must be the embedding output (Eagle3Head's indices)
                n = model.config.num_hidden_layers
                if len(hs) != n + 1:
                    raise SystemExit(f"{len(hs)} hidden states for {n} layers")
                emb = model.model.embed_tokens(ids.to(dev))
                if not torch.equal(hs[0], emb):
                    raise SystemExit("hidden_states[0] is not the embedding output")
                checked = True
            states = torch.cat([hs[i] for i in layers], -1)
        for r, i in enumerate(g):
            n = len(seqs[i])
            res[i] = (last[r, :n].to(torch.bfloat16).clone(), labels[r, :n].clone(),
                      states[r, :n].to(torch.bfloat16).clone() if layers is not None else None)
        s = e
    return res


def save_split_head(out: Path, head: torch.nn.Module, meta: dict, max_bytes: int = 15_000_000) -> None:
    from safetensors.torch import save_file

    groups: list[dict] = [{}]
    size = 0
    for k, v in head.state_dict().items():
        v = v.detach().to(torch.bfloat16).contiguous().cpu()
        b = v.numel() * 2
        if groups[-1] and size + b > max_bytes:
            groups.append({})
            size = 0
        groups[-1][k] = v
        size += b
    for i, g in enumerate(groups):
        tmp = out / f".head-{i}.tmp"
        save_file(g, str(tmp))
        os.replace(tmp, out / f"head-{i}.safetensors")
    meta = {**meta, "files": len(groups)}
    tmp = out / ".head.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "head.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="the target's GGUF")
    src.add_argument("--gguf-parts", type=Path, help="a folder of part* files that concatenate to the GGUF")
    ap.add_argument("--sha256", default=get_entry(DEFAULT_MODEL).sha256,
                    help=f"the GGUF's sha256 ('' to skip the check; default: {DEFAULT_MODEL}'s, from the registry)")
    ap.add_argument("--prompts", type=Path, required=True, help="gzipped JSONL from head_prompt_mix.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kind", choices=["eagle3", "eagle"], default="eagle3")
    ap.add_argument("--init", type=Path,
                    help="start from this head directory (e.g. the bundled one) instead of random weights; its "
                         "kind and config are kept")
    ap.add_argument("--tokens", type=Path, action="append", default=[],
                    help="tokens.npz of an earlier run: its sequences join the training data without being "
                         "generated again (repeatable)")
    ap.add_argument("--intermediate", type=int, default=768, help="the head's MLP width (default: %(default)s)")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the whole run")
    ap.add_argument("--gen-until", type=float, default=0.45,
                    help="fraction of the budget after which no generation batch starts (default: %(default)s)")
    ap.add_argument("--magpie", type=int, default=1024, help="Magpie prompts written by the target")
    ap.add_argument("--max-prompts", type=int, default=100000)
    ap.add_argument("--gen-tokens", type=int, default=384)
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=512, help="training window (tokens)")
    ap.add_argument("--batch", type=int, default=16, help="windows per step")
    ap.add_argument("--pack", type=int, default=8,
                    help="windows side by side in one call of the head (block-diagonal attention; default: %(default)s)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--train-vocab", type=int, default=32768)
    ap.add_argument("--heldout", type=int, default=48, help="sequences held apart for accuracy")
    ap.add_argument("--save-every", type=float, default=45.0)
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the Magpie samples (another seed: other requests than an earlier run's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    init = read_head(a.init)[0] if a.init else None
    if init is not None:
        a.kind = init.kind
    t0 = time.time()
    deadline = t0 + a.minutes * 60
    a.out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    torch.manual_seed(a.seed)

    # ---- the target
    if a.gguf_parts:
        dest = Path("/tmp/leapdecode-target/target.gguf")
        dest.parent.mkdir(parents=True, exist_ok=True)
        gguf = assemble(a.gguf_parts, dest, a.sha256 or None)
    else:
        gguf = a.gguf
    timings["assemble_s"] = round(time.time() - t0, 1)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t = time.time()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, a.dtype)).to(a.device).eval()
    timings["load_s"] = round(time.time() - t, 1)
    cfg = model.config
    log(f"loaded {gguf.name} in {timings['load_s']} s: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}")
    eos = sorted({int(x) for x in ([cfg.eos_token_id] if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id or [])}
                 | {tok.convert_tokens_to_ids(x) for x in ("<|im_end|>", "<|endoftext|>") if x in tok.get_vocab()})
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]

    # ---- prompts: the file's, then Magpie's
    items = [json.loads(line) for line in gzip.open(a.prompts, "rt", encoding="utf-8") if line.strip()]
    items = items[: a.max_prompts]
    gen_deadline = t0 + a.gen_until * a.minutes * 60
    t = time.time()
    magpie: list[str] = []
    if a.magpie:
        prefix = tok.encode(user_turn_prefix(tok), add_special_tokens=False)
        qs = generate(model, [prefix] * a.magpie, 160, a.gen_batch * 2, gen_deadline, eos, pad, sample=True)
        seen = set()
        for q in qs:
            if q and q[-1] in eos:  # a finished request
                text = tok.decode(q[:-1]).strip()
                if len(text) > 16 and text not in seen:
                    seen.add(text)
                    magpie.append(text)
        log(f"magpie: {len(magpie)} requests from {a.magpie} samples in {time.time() - t:.1f} s")
    timings["magpie_s"] = round(time.time() - t, 1)
    prompts, kinds, follow = [], [], []
    for it in items:
        if "chat" in it:
            prompts.append(chat_ids(tok, it["chat"])[-a.prompt_tokens:])
            kinds.append("chat")
        else:
            prompts.append(tok.encode(it["prompt"])[-a.prompt_tokens:])
            kinds.append("prompt")
        follow.append(it.get("then"))
    for q in magpie:
        prompts.append(chat_ids(tok, q)[-a.prompt_tokens:])
        kinds.append("magpie")
        follow.append(None)
    t = time.time()
    answers = generate(model, prompts, a.gen_tokens, a.gen_batch, gen_deadline, eos, pad)
    seqs = [p + r for p, r in zip(prompts, answers) if r]
    seq_kinds = [k for k, r in zip(kinds, answers) if r]
    second = [chat_ids(tok, f.format(a=tok.decode(r, skip_special_tokens=True).strip()))[-a.prompt_tokens:]
              for f, r in zip(follow, answers) if f and r]
    if second:
        ans2 = generate(model, second, a.gen_tokens, a.gen_batch, gen_deadline + 30, eos, pad)
        seqs += [p + r for p, r in zip(second, ans2) if r]
        seq_kinds += ["then" for r in ans2 if r]
    generated = sum(len(s) for s in seqs) - sum(len(p) for p, r in zip(prompts, answers) if r)
    timings["generate_s"] = round(time.time() - t, 1)
    log(f"generated {len(seqs)} answers ({generated} tokens) in {timings['generate_s']} s "
        f"({generated / max(timings['generate_s'], 1e-9):.0f} tokens/s)")
    fresh = len(seqs)  # this run's sequences; the earlier runs' follow
    earlier_held: list[int] = []
    for path in a.tokens:  # an earlier run's sequences; its held-apart ones stay held apart
        z = np.load(path)
        earlier_held += [len(seqs) + int(i) for i in z["heldout"]]
        ends = np.cumsum(z["lengths"])
        seqs += [z["tokens"][e - n : e].tolist() for e, n in zip(ends, z["lengths"])]
        seq_kinds += [f"earlier {k}" for k in z["kinds"].tolist()]
    reused = len(seqs) - fresh

    # ---- features
    layers = None if a.kind != "eagle3" else (
        list(init.config["layers"]) if init is not None else default_layers(cfg.num_hidden_layers))
    t = time.time()
    data = features(model, seqs, layers, batch_tokens=16384)
    timings["features_s"] = round(time.time() - t, 1)
    n_tok = sum(len(s) for s in seqs)
    log(f"features of {len(seqs)} sequences, {n_tok} tokens in {timings['features_s']} s")
    rng = random.Random(0)
    idx = list(range(fresh))
    rng.shuffle(idx)
    held = idx[: a.heldout] + earlier_held  # never trained on
    held_set = set(held)
    train = [i for i in range(len(seqs)) if i not in held_set]
    np.savez_compressed(a.out / "tokens.npz", tokens=np.concatenate([np.array(s, dtype=np.int32) for s in seqs]),
                        lengths=np.array([len(s) for s in seqs], dtype=np.int32),
                        kinds=np.array(seq_kinds), heldout=np.array(held, dtype=np.int32))

    # ---- the head
    if init is not None:
        head = init
    else:
        theta = float(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
        common = (cfg.hidden_size, cfg.num_attention_heads, a.intermediate, theta, cfg.rms_norm_eps)
        head = Eagle3Head(*common, layers) if a.kind == "eagle3" else EagleHead(*common)
    head = head.float().to(a.device).train()
    weight = model.lm_head.weight[: a.train_vocab].detach().float()
    embed = model.model.embed_tokens
    opt = torch.optim.AdamW(head.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    lengths = np.array([len(seqs[i]) for i in train], dtype=np.float64)
    p_seq = lengths / lengths.sum()
    gen = torch.Generator().manual_seed(0)
    nprng = np.random.default_rng(0)
    t_train = time.time()
    train_end = deadline - 25
    total = max(train_end - t_train, 1.0)
    warm = 60
    step, losses, last_save = 0, [], time.time()
    meta = {"kind": a.kind, "config": head.config, "target_sha256": a.sha256, "gguf": gguf.name,
            "init": str(a.init) if a.init else None,
            "data": {"prompts_file": len(items), "magpie": len(magpie), "sequences": len(seqs), "reused": reused,
                     "tokens": n_tok, "generated_tokens": generated,
                     "by_kind": {k: seq_kinds.count(k) for k in sorted(set(seq_kinds))}, "heldout": len(held)},
            "recipe": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
                       for k, v in vars(a).items()},
            "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device}

    def accuracy() -> list[float]:
        head.eval()
        hits = [0] * a.ttt_steps
        cnt = [0] * a.ttt_steps
        with torch.no_grad(), torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16):
            for i in held:
                f, lab, st = data[i]
                toks = torch.tensor(seqs[i], device=a.device)
                m = min(len(seqs[i]), 1024) - 1
                if m < 2:
                    continue
                inp = head.fuse_states(st[:m].float()) if a.kind == "eagle3" else f[:m].float()
                emb = embed(toks).float()
                emb = torch.cat([emb, emb.new_zeros(a.ttt_steps, emb.shape[-1])])
                for j, (h, c) in enumerate(chain_hits(head, inp, emb, lab, weight, a.ttt_steps)):
                    hits[j] += h
                    cnt[j] += c
        head.train()
        return [round(h / max(c, 1), 4) for h, c in zip(hits, cnt)]

    def checkpoint(final: bool = False) -> None:
        meta.update(steps=step, train_s=round(time.time() - t_train, 1), timings=timings,
                    loss=round(float(np.mean(losses[-50:])), 4) if losses else None,
                    window_tokens=step * a.batch * a.seq_len)
        if final:
            meta["heldout_top1"] = accuracy()
        save_split_head(a.out, head, meta)

    while time.time() < train_end:
        frac = (time.time() - t_train) / total
        lr = a.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss = torch.zeros((), device=a.device)
        picks = [train[int(i)] for i in nprng.choice(len(train), size=a.batch, p=p_seq)]
        with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16):
            for c in range(0, a.batch, a.pack):  # `pack` windows side by side in one call (segments)
                fs, ts, ls, ss, seg = [], [], [], [], []
                for w, k in enumerate(picks[c : c + a.pack]):
                    f, lab, st = data[k]
                    s = int(nprng.integers(0, max(1, f.shape[0] - a.seq_len + 1)))
                    sl = slice(s, s + a.seq_len)
                    fs.append(f[sl])
                    ts.append(torch.tensor(seqs[k][sl], device=a.device))
                    ls.append(lab[sl])
                    ss.append(st[sl] if st is not None else None)
                    seg.append(torch.full((fs[-1].shape[0],), w, device=a.device))
                part = eagle_loss(head, torch.cat(fs).float(), torch.cat(ts), torch.cat(ls), weight, embed,
                                  generator=gen, ttt_steps=a.ttt_steps,
                                  states=torch.cat(ss).float() if ss[0] is not None else None,
                                  segments=torch.cat(seg))
                loss = loss + part * len(fs)
        losses.append(optimizer_step(head, opt, loss / a.batch))
        step += 1
        if step % 100 == 0:
            log(f"step {step}: loss {np.mean(losses[-100:]):.4f}, lr {lr:.2e}, {time.time() - t_train:.0f} s")
        if time.time() - last_save > a.save_every:
            checkpoint()
            last_save = time.time()
    timings["train_s"] = round(time.time() - t_train, 1)
    checkpoint(final=True)
    log(f"done: {step} steps, loss {meta['loss']}, held-apart top-1 per step {meta['heldout_top1']}, "
        f"{time.time() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
