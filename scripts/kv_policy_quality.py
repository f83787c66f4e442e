"""What each KV-cache policy saves and what it costs: NLL of a reference continuation under
teacher forcing, with the policy compressing as decoding proceeds (issue 14 section 3).

For each document: the prompt (``--prompt-tokens``) is prefilled as a generation with that policy
prefills it (chunks of ``kv_policy.PREFILL_CHUNK`` tokens, the policy running after each), then
the reference continuation (``--continuation`` tokens) is fed one token per forward, exactly as
greedy decoding would commit it, the policy running after every token; the NLL of each reference
token is read from the logits of the forward before it.  ``none`` is the exact cache.  Reported
per policy: the mean NLL per token (all documents' tokens together), its increase over ``none``,
the KV tokens and bytes held at the end, and the slot a generation of that length reserves.

Documents (real text shipped with Python, nothing downloaded): ``prose``, the language reference
text of ``pydoc_data.topics`` (topic ``specialnames``: "3.3. Special method names"), and ``code``,
the source of the standard library's ``argparse.py`` from ``class HelpFormatter`` on.

    python scripts/kv_policy_quality.py -m smollm2-135m --budgets 128,256,512
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch

import leapdecode
from leapdecode.core.generate import cache_tokens
from leapdecode.core.kv_policy import PREFILL_CHUNK, parse_kv_policy
from leapdecode.core.runner import ModelRunner, slot_len
from leapdecode.models.kv_cache import cache_bytes_per_token
from leapdecode.models.native import BatchItem


def documents(tokenizer, names: list[str]) -> dict[str, list[int]]:
    out = {}
    for name in names:
        if name == "prose":
            import pydoc_data.topics as topics

            text = topics.topics["specialnames"]
        elif name == "code":
            import argparse as argparse_module

            text = open(argparse_module.__file__, encoding="utf-8").read()
            text = text[text.index("class HelpFormatter"):]
        else:
            raise SystemExit(f"unknown document {name!r}: prose or code")
        out[name] = tokenizer.encode(text)
    return out


def specs_for(budget: int) -> list[str]:
    return [
        f"streaming:sink=4,window={budget - 4}",
        f"h2o:budget={budget},recent={budget // 2}",  # H2O's equal split of heavy hitters and recent tokens
        f"snapkv:budget={budget},window=32",
        f"scope:prefill={budget},decode={budget // 2},recent={budget // 8},window=32",
        f"expected:budget={budget}",
    ]


class Run:
    """One policy on one document: its cache and policy state, and the NLL of each reference token."""

    def __init__(self, model, runner: ModelRunner, spec: str | None, prompt_len: int, cont: int) -> None:
        self.spec = spec
        self.policy = parse_kv_policy(spec)
        want = cache_tokens(model, prompt_len, cont, self.policy)
        self.slot = slot_len(model, want)
        kind = self.policy.cache_kind if self.policy is not None else "plain"
        self.cache = runner.acquire_cache(model, want, kind=kind)
        self.state = self.policy.start(model, self.cache) if self.policy is not None else None
        self.nll: list[float] = []

    def prefill(self, decoder, body: list[int], restored: int = 0) -> None:
        """Prompt chunks from token ``restored`` on (those before were appended from the exact run)."""
        for s in range(restored, len(body), PREFILL_CHUNK):
            chunk = body[s : s + PREFILL_CHUNK]
            decoder.forward(torch.tensor([chunk]), self.cache, logits_for=slice(0, 0))
            self.cache.commit()
            if self.state is not None:
                self.state.committed(range(len(chunk)), "prefill" if s + PREFILL_CHUNK < len(body) else "prefill_end")

    def committed(self) -> None:
        self.cache.commit()
        if self.state is not None:
            self.state.committed([0], "decode")


@torch.inference_mode()
def run_document(model, ids: list[int], prompt_len: int, cont: int, specs: list[str | None]) -> list[Run]:
    """Every policy on one document.  Prompts: the exact run prefills alone; the policies whose
    prefill is exact until its end (snapkv, scope) start from a copy of its KV up to the last
    chunk and run that chunk themselves (their observation window); the others prefill alone.
    Continuation: every run's next token in one batched forward per step (``forward_batch``: the
    same bits as one forward each with the default batch-invariant kernels)."""
    decoder = model.model
    runner = ModelRunner(model, prefix_cache_bytes=0)
    runs = [Run(model, runner, spec, prompt_len, cont) for spec in specs]
    body = ids[: prompt_len - 1]
    last = (len(body) - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # where the last prompt chunk starts
    exact = next(r for r in runs if r.policy is None)
    exact.prefill(decoder, body)
    k, v = exact.cache.committed_slice(0, last)
    for r in runs:
        if r is exact:
            continue
        if r.policy.name in ("snapkv", "scope"):
            r.cache.append_committed(k, v)
            r.prefill(decoder, body, restored=last)
        else:
            r.prefill(decoder, body)
    seq = ids[prompt_len - 1 : prompt_len + cont]
    for i in range(cont):
        items = [BatchItem(torch.tensor([seq[i]]), r.cache) for r in runs]
        for r, logits in zip(runs, decoder.forward_batch(items)):
            logits = logits[0, -1].float()
            r.nll.append(float(torch.logsumexp(logits, -1) - logits[seq[i + 1]]))
            r.committed()
    for r in runs:
        r.held, r.per_token = r.cache.length, r.cache.bytes_per_slot
        runner.release_cache(r.cache)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("--budgets", default="128,256,512")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--docs", default="prose,code")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = leapdecode.load(a.model)
    docs = documents(model.tokenizer, a.docs.split(","))
    for name, ids in docs.items():
        if len(ids) < a.prompt_tokens + a.continuation + 1:
            raise SystemExit(f"document {name} has only {len(ids)} tokens")
    budgets = [int(b) for b in a.budgets.split(",")]
    specs: list[str | None] = [None, "int8"] + [s for b in budgets for s in specs_for(b)]
    cfg = model.model.cfg
    full_per_token = cache_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, model.dtype)
    print(f"# {a.model} ({model.weights}, {model.model.attention} attention), {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {a.threads} threads; prompt {a.prompt_tokens} tokens, continuation "
          f"{a.continuation}, documents {', '.join(docs)}", file=sys.stderr)
    t0 = time.perf_counter()
    per_doc = [run_document(model, ids, a.prompt_tokens, a.continuation, specs) for ids in docs.values()]
    wall = time.perf_counter() - t0
    rows = []
    base_nll = None
    full_bytes = (a.prompt_tokens - 1 + a.continuation) * full_per_token
    for j, spec in enumerate(specs):
        runs = [doc[j] for doc in per_doc]
        nll = [x for r in runs for x in r.nll]
        mean = sum(nll) / len(nll)
        if spec is None:
            base_nll = mean
        held = max(r.held for r in runs)
        held_bytes = held * runs[0].per_token
        row = {"policy": spec or "none (exact)", "nll": round(mean, 4), "delta_nll": round(mean - base_nll, 4),
               "ppl": round(math.exp(mean), 3), "held_tokens": held, "held_mib": round(held_bytes / 2**20, 2),
               "held_share": round(held_bytes / full_bytes, 3), "slot_tokens": runs[0].slot,
               "slot_mib": round(runs[0].slot * runs[0].per_token / 2**20, 2),
               "nll_per_doc": [round(sum(r.nll) / len(r.nll), 4) for r in runs]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"# wall time {wall:.0f} s", file=sys.stderr)
    names = list(docs)
    print("| policy | KV held at the end: tokens / MiB (share of exact) | slot reserved: tokens / MiB | "
          f"mean NLL | ΔNLL vs exact | NLL per document ({', '.join(names)}) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['policy']}` | {r['held_tokens']} / {r['held_mib']} ({r['held_share']:.0%}) | "
              f"{r['slot_tokens']} / {r['slot_mib']} | {r['nll']:.4f} | {r['delta_nll']:+.4f} | "
              f"{' / '.join(f'{x:.4f}' for x in r['nll_per_doc'])} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
