"""``leapdecode bench --ceiling``: how fast could the decoding phase be?  Ceilings of the speedup over
vanilla, per workload.

Runs vanilla (greedy; constrained with ``--json-object``) on the bench's prompts, as
``scripts/decode_phase.py`` does, then replays each output against the target's verification cost
profile (``ModelRunner.verify_cost``: a forward of n tokens costs ``cost(n)``; vanilla pays
``cost(1)`` a token) and prints, in forward-cost units (host time, drafting and the grammar left
out: these are upper bounds):

* **copy oracle**: each step drafts the continuation of the longest suffix of the text (prompt and
  output so far) that occurred before, most recent occurrence (what ``pld`` and ``sam`` copy), cut
  to exactly the tokens the target then accepts: the best any copy drafter with perfect lengths
  could do;
* **copy oracle with memory** (``--memory``): the same, but the text it copies from also holds the
  outputs of the requests before (in the workload's order, as a server's cross-request memory
  would: ``suffix``, ``auto:use_memory=true``), the request's own text winning ties: what earlier
  requests can add to copying at best;
* **perfect drafter**: knows the output and drafts, at every step, the number of its next tokens
  that minimises the total cost (dynamic programming): the ceiling of any drafter on this machine's
  verification costs.

``--replay sam,pld,suffix:cost_aware=false`` also replays model-free methods (those whose drafts
depend on the text alone: ``sam``, ``pld``, ``suffix``) through their own proposers against the
same outputs and costs: greedy decoding emits vanilla's tokens whatever is drafted, so the verdict
of each proposed tree follows from the output, and the replay gives the method's decoding-phase
speedup in forward-cost units without running the model (its drafting time and the profile's
online corrections left out).  The outputs of the requests before share one runner memory, in the
workload's order, as a bench row's requests do.  ``--outputs FILE`` keeps vanilla's outputs and
the verification profile, so that replays of other settings run in seconds.

Each ceiling is printed overall and per category; ``--save FILE`` also writes them as a report
that ``leapdecode results`` shows beside the speedup targets (``docs/results/ceilings/``).

    leapdecode bench --ceiling --categories extraction --json-object
    leapdecode bench --ceiling --workload humaneval-heldout --max-new-tokens 128
    leapdecode bench --ceiling --workload similar --limit 24 --max-new-tokens 128 --memory \
        --save docs/results/ceilings/DATE-MACHINE-similar.json
    leapdecode bench --ceiling --limit 8 --max-new-tokens 128 --outputs /tmp/dev8.json \
        --replay sam,pld,suffix,sam:cost_aware=false

(``scripts/draft_ceiling.py``, where this began, runs the same with its own default of 192 new tokens.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..cli_args import LoadOptions
from ..errors import InvalidParameterError
from ..proposers.pld import NGramIndex

MAX_DRAFT = 32  # the most tokens a step may draft (the default tree budgets are 24-32)
MAX_MATCH = 16  # the longest suffix the copy oracle looks for
SEPARATOR = -1  # between remembered outputs: never a token, so no match crosses it


def _match_continuation(index: NGramIndex) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix of ``index``'s text
    that occurred before (pld's n-gram index); [] without one."""
    text = index.text
    for n in range(min(index.max_ngram, len(text) - 1), 0, -1):
        positions = index.lookup(n)
        if positions:
            return text[positions[-1]:positions[-1] + MAX_DRAFT]
    return []


def copy_continuation_at(text: Sequence[int], max_match: int = MAX_MATCH) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix of ``text`` (up to
    ``max_match`` tokens) that occurred before; [] without one."""
    index = NGramIndex(max_match)
    index.extend(text)
    return _match_continuation(index)


def copy_oracle_cost(prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float],
                     memory: Sequence[Sequence[int]] = ()) -> float:
    """Total verification cost of ``output`` when each step drafts the copy continuation's tokens that
    match the output (none where it is wrong at once); ``memory``: earlier outputs it may copy from
    too (before the prompt, so that on a tie the request's own, more recent text wins)."""
    index, i, total = NGramIndex(MAX_MATCH), 0, 0.0
    for doc in memory:
        index.extend(doc)
        index.append(SEPARATOR)
    index.extend(prompt)
    while i < len(output):
        cont = _match_continuation(index)
        a = 0
        while a < len(cont) and i + a < len(output) and cont[a] == output[i + a]:
            a += 1
        total += cost(1 + a)
        index.extend(output[i:i + a + 1])
        i += a + 1
    return total


def perfect_cost(n_tokens: int, cost: Callable[[int], float]) -> float:
    """The least total cost of emitting ``n_tokens`` tokens in steps of 1 + a tokens (a drafted and
    accepted, 0 <= a < MAX_DRAFT), a step costing ``cost(1 + a)``."""
    best = [0.0] * (n_tokens + 1)
    for i in range(n_tokens - 1, -1, -1):
        best[i] = min(cost(1 + a) + best[min(n_tokens, i + a + 1)] for a in range(MAX_DRAFT))
    return best[0]


REPLAYABLE = ("pld", "sam", "suffix")  # methods whose trees depend on the text alone (no model, no logits)
END = -2  # the position after an output: its end-of-sequence token, which no draft holds


class ReplayRunner:
    """What a model-free proposer reads of a runner: its memory across generations."""

    def __init__(self) -> None:
        from ..core.runner import ProposerMemory

        self.model = None
        self.memory = ProposerMemory()


def replay_proposer(method: str):
    """``METHOD`` or ``METHOD:KEY=VALUE...`` (as a bench row) -> a factory of ``(proposer, runner, tree
    budget)``, a new proposer per request on one shared replay runner (as a bench row's requests);
    ``InvalidParameterError`` names a method that needs a model."""
    from ..proposers import build_proposer, method_config
    from .runners import split_method_row

    base, opts = split_method_row(method)
    if base not in REPLAYABLE:
        raise InvalidParameterError(f"--replay: {base!r} needs the model to draft; replayable: "
                                    f"{', '.join(REPLAYABLE)}")
    cfg = method_config(base, opts)
    runner = ReplayRunner()

    def make():
        proposer = build_proposer(cfg, runner)
        return proposer, runner, cfg.tree_budget or proposer.default_budget

    return make


def replay_cost(make, prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float], verify,
                max_new_tokens: int) -> tuple[float, int]:
    """Greedy decoding of ``output`` after ``prompt`` with the proposer ``make()`` builds: each step's
    tree is verified against the output (its accepted path is the output's next tokens, as greedy
    verification finds them) and costs ``cost(1 + tree size)``; the proposer learns from each
    verdict as in a generation (``verify``: the profile it sizes by).  Returns (total cost, steps)."""
    import torch

    from ..core.proposer import DecodeContext
    from ..core.sampling import SamplingParams
    from ..core.verifier import Verdict, follow_path

    proposer, runner, tree_budget = make()
    ctx = DecodeContext(runner=runner, cache=None, params=SamplingParams(), generator=torch.Generator(),
                        prompt_len=len(prompt), max_new_tokens=max_new_tokens, verify_cost=verify)
    tokens = list(prompt)
    proposer.begin(ctx, list(tokens))
    total, steps, i = 0.0, 0, 0
    target = list(output) + [END]
    while i < len(output):
        budget = min(tree_budget, max(max_new_tokens - i - 1, 0))
        tree = proposer.propose(list(tokens), budget).truncated(budget)
        verdict = follow_path(tree, tree.child_map(), lambda row, depth: target[i + depth])
        if verdict.next_token == END:  # the output ended on the accepted path: END is not emitted
            verdict = Verdict(verdict.accepted, END, verdict.tokens[:-1])
        total += cost(1 + len(tree))
        steps += 1
        tokens += verdict.tokens
        i += len(verdict.tokens)
        proposer.observe(list(tokens), tree, verdict, None)
    proposer.end()
    return total, steps


@dataclass
class CeilingConfig:
    model: str
    workload: str | None = None  # as the bench's --workload (None: Spec-Bench dev)
    categories: list[str] | None = None
    limit: int | None = None  # questions, sampled as the bench does
    seed: int = 0
    json_object: bool = False  # constrain every output to a JSON object
    max_new_tokens: int = 256
    memory: bool = False  # also the copy oracle that may copy from the earlier requests' outputs
    replay: list[str] = field(default_factory=list)  # model-free method rows replayed against the outputs
    outputs: Path | None = None  # keeps vanilla's outputs and the verification profile
    save: Path | None = None  # the ceilings as a JSON report (for `leapdecode results`)
    load_options: LoadOptions = field(default_factory=LoadOptions)
    command: str | None = None  # the command line, recorded in the report


def report(cfg: CeilingConfig, model: str, workload: str, machine: str, cpu_flags: list[str] | None,
           relative: dict[int, float], tokens: dict[str, int], spent: dict[str, dict[str, float]]) -> dict:
    """The ceilings as ``leapdecode results`` reads them: per ceiling its speedup overall and per group
    (replayed methods, ``replayed ...`` rows of ``spent``, under ``replays``: they are not ceilings)."""
    n = sum(tokens.values())

    def speedups(rows: dict[str, dict[str, float]]) -> dict:
        return {name: {"overall": round(n / sum(by.values()), 4), "by_group": {g: round(tokens[g] / c, 4) for g, c in by.items()}}
                for name, by in rows.items()}

    replayed = {k[len("replayed "):]: v for k, v in spent.items() if k.startswith("replayed ")}
    return {"report": "draft-ceiling", "model": model, "workload": workload, "limit": cfg.limit,
            "max_new_tokens": cfg.max_new_tokens, "machine": machine, "cpu_flags": cpu_flags, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": cfg.command, "tokens": n,
            "relative_cost": {str(k): round(v, 4) for k, v in sorted(relative.items())},
            "ceilings": speedups({k: v for k, v in spent.items() if not k.startswith("replayed ")}),
            **({"replays": speedups(replayed)} if replayed else {})}


def outputs_key(cfg: CeilingConfig) -> dict:
    """What vanilla's outputs depend on (an ``--outputs`` file made otherwise is not reused)."""
    return {"model": cfg.model, "workload": cfg.workload,
            "categories": ",".join(cfg.categories) if cfg.categories else None, "limit": cfg.limit, "seed": cfg.seed,
            "json_object": cfg.json_object, "max_new_tokens": cfg.max_new_tokens}


def load_outputs(cfg: CeilingConfig, say: Callable[[str], None]) -> dict | None:
    """A kept run (``--outputs``) made with these options, or None."""
    path = cfg.outputs
    if path is None or not path.exists():
        return None
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidParameterError(f"--outputs {path}: not a readable outputs file ({e})") from None
    if not isinstance(kept, dict) or kept.get("key") != outputs_key(cfg):
        say(f"{path} was made with other options: running vanilla again")
        return None
    return kept


def run_vanilla(cfg: CeilingConfig, say: Callable[[str], None]) -> dict:
    """Vanilla's outputs on the workload and the target's verification profile."""
    from ..api import generate
    from ..core.cost_model import machine_description
    from ..core.runner import ModelRunner
    from ..models.kernel_library import isa_flags
    from .suite import encode_turn, structure_of
    from .workloads import load_workload, select

    questions, workload = load_workload(cfg.workload)  # (an unknown workload or category fails before the model loads)
    questions = select(questions, cfg.limit, cfg.categories, cfg.seed)
    if cfg.json_object:  # as the bench: a workload's own schemas stay
        for q in questions:
            q.meta.setdefault("json_schema", {"type": "object"})
    model = cfg.load_options.load(cfg.model)
    runner = ModelRunner(model, prefix_cache_bytes=0)
    outputs = []  # [group, prompt ids, output ids] in the workload's order
    for q in questions:
        history: list[dict] = []
        for turn in q.turns:
            ids = encode_turn(model, q, history, turn)
            res = generate(runner, prompt_ids=ids, max_new_tokens=cfg.max_new_tokens, method="vanilla",
                           **(structure_of(q) or {}))
            outputs.append([q.category, list(ids), list(res.tokens)])
            say(f"question {q.question_id}: {len(res.tokens)} tokens")
            history += [{"role": "user", "content": turn}, {"role": "assistant", "content": res.text}]
    verify = runner.verify_cost(model.model.new_cache(max_len=1024))
    return {"key": outputs_key(cfg), "workload": workload, "machine": machine_description(model.device),
            "cpu_flags": isa_flags() if model.device.type == "cpu" else None,
            "profile": {"sizes": list(verify.sizes), "seconds": list(verify.seconds)}, "outputs": outputs}


def run_ceiling(cfg: CeilingConfig, say: Callable[[str], None]) -> dict | None:
    """The ceilings (and replays) printed through ``say`` as a table, overall and per category; the
    report (``--save``) when one is saved, else None."""
    from ..core.cost_model import VerifyCost
    from ..models.store import atomic_write

    replays = [(m, replay_proposer(m)) for m in cfg.replay]
    run = load_outputs(cfg, say)
    if run is None:
        run = run_vanilla(cfg, say)
        if cfg.outputs is not None:
            atomic_write(cfg.outputs, json.dumps(run))
            say(f"kept the outputs in {cfg.outputs}")
    outputs, workload = run["outputs"], run["workload"]
    verify = VerifyCost(run["profile"]["sizes"], run["profile"]["seconds"])
    rel = verify.relative()
    unit = verify(1)

    def cost(n: int) -> float:
        return verify(n) / unit

    rows = [("copy oracle", lambda i, ids, out: copy_oracle_cost(ids, out, cost))]
    if cfg.memory:
        rows.append(("copy oracle with memory",
                     lambda i, ids, out: copy_oracle_cost(ids, out, cost, [o for _, _, o in outputs[:i]])))
    rows.append(("perfect drafter", lambda i, ids, out: perfect_cost(len(out), cost)))
    for name, make in replays:  # one runner memory per replayed row, across its requests
        rows.append((f"replayed {name}", lambda i, ids, out, f=make:
                     replay_cost(f, ids, out, cost, verify, cfg.max_new_tokens)))
    groups = sorted({g for g, _, _ in outputs})
    spent = {name: {g: 0.0 for g in groups} for name, _ in rows}
    steps = {name: 0 for name, _ in rows}  # a replayed row's forwards
    tokens = {g: 0 for g in groups}
    for i, (g, ids, out) in enumerate(outputs):
        tokens[g] += len(out)
        for name, f in rows:
            got = f(i, ids, out)
            if isinstance(got, tuple):
                got, n = got
                steps[name] += n
            spent[name][g] += got
    n_tokens = sum(tokens.values())
    say(f"\n{cfg.model}, {len(outputs)} outputs, {n_tokens} tokens; verification cost relative to one token: "
        + ", ".join(f"{n}: {v:.2f}" for n, v in sorted(rel.items())))
    say("| decoding phase | cost (1-token forwards) | tokens a forward | speedup ceiling | " + " | ".join(groups) + " |")
    say("|---|---:|---:|---:|" + "---:|" * len(groups))
    say(f"| vanilla | {n_tokens:.1f} | 1.00 | 1.00x |" + " 1.00x |" * len(groups))
    for name, _ in rows:
        total = sum(spent[name].values())
        per = f"{n_tokens / steps[name]:.2f}" if steps[name] else "-"
        say(f"| {name} | {total:.1f} | {per} | {n_tokens / total:.2f}x | "
            + " | ".join(f"{tokens[g] / spent[name][g]:.2f}x" for g in groups) + " |")
    if cfg.save is None:
        return None
    r = report(cfg, cfg.model, workload, run["machine"], run["cpu_flags"], rel, tokens, spent)
    atomic_write(cfg.save, json.dumps(r, indent=2) + "\n")
    say(f"saved {cfg.save}")
    return r
