"""What the test-time scaling strategies share: N samples of one prompt, decoded as one batch.

**The prompt once, N sequences in one batch.**  The first sample prefills the prompt (all but its
last token, in the position-0-aligned chunks of ``Generation``, through the runner's prefix
cache); the other N - 1 copy its keys and values into their own cache slots
(``Generation.adopt_prompt``: the bits each would have computed, so exact), so the prompt's
forwards run once, whatever N.  (Each sample's slot holds its own copy of the prompt's keys and
values: the compute is shared, the memory is not.)  Then every round is one batched forward of
all live samples (``core/batch.run_forwards``: ``NativeCausalLM.forward_batch``, each sequence's
rows through the linear layers together, attention per sequence), each sample verifying its own
proposer's tree with ragged acceptance, as the server's continuous batching does.

**Each sample is a plain sampled generation.**  Sample i is a ``Generation`` with its own seed
(drawn from the request's seed), its own proposer (``method``: any, all are exact in
distribution) and the request's sampling parameters and stop strings: it is distributed exactly
as ``generate(...)`` with that seed, and with the batch-invariant kernels it is that generation
token for token.  A strategy only decides which samples to keep going, when to stop, and which
to return; those decisions read each sample's tokens and the model's log-probabilities of them
(recorded from the forwards that produced them: no extra forward), never the speed of its
speculation (a checkpoint reads the same prefix length of every sample).

A strategy subclasses ``ParallelSamples`` and implements ``after_round()`` (decide after each
round: stop early, reject samples) and ``hypotheses()`` (the hypotheses, best first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..core.generate import Generation
from ..core.task import Forward, StepOutput
from ..core.sampling import SamplingParams
from ..errors import InvalidParameterError
from ..proposers.registry import build_proposer
from .scorers import Sample
from .search import Hypothesis, SearchResult, StrategyConfig, TreeSearch

if TYPE_CHECKING:
    from ..core.config import MethodConfig
    from ..core.runner import ModelRunner


@dataclass
class Member:
    """One sample in flight: its generation, its seed, and what it emitted with the model's
    log-probabilities (temperature 1) of each emitted token."""

    index: int
    seed: int
    gen: Generation
    emitted: list[int] = field(default_factory=list)  # every token decided, beyond any stop cut
    logprobs: list[float] = field(default_factory=list)  # one per emitted token
    rejected: bool = False  # stopped early by the strategy (its tokens are not a finished sample)

    @property
    def done(self) -> bool:
        return self.gen.finished

    @property
    def live(self) -> bool:
        return not self.gen.finished and not self.rejected

    def scored_tokens(self) -> list[int]:
        """A finished sample's tokens: its output, and the end-of-sequence token it ended on."""
        res = self.gen.result
        n = len(res.tokens)
        if res.finish_reason == "stop" and len(self.emitted) > n and self.emitted[n] in self.gen.model.eos_token_ids:
            n += 1
        return self.emitted[:n]


def _path_rows(tree: Any, emitted: list[int]) -> list[int]:
    """The forward's row that predicted each emitted token: the root's (0) for the first, then the
    tree node that holds the token before (its row: node + 1)."""
    rows, node = [0], -1
    for t in emitted[:-1]:
        nxt = None
        for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
            if p == node and tok == t:
                nxt = i
                break
        if nxt is None:  # the verifier only emits tree tokens before its last one
            raise RuntimeError("an emitted token is not on the verified tree")
        node = nxt
        rows.append(node + 1)
    return rows


def sample_seeds(seed: int | None, n: int) -> list[int]:
    """The samples' seeds: drawn from ``seed`` (same seed, same samples), or at random."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return [int(x) for x in torch.randint(0, 2**62, (n,), generator=g).tolist()]


class ParallelSamples(TreeSearch):
    """N sampled generations of one prompt, one batched forward per round; see the module docstring."""

    @classmethod
    def kv_tokens(cls, model: Any, prompt_len: int, max_new_tokens: int, *, strategy: Any = None,
                  kv_policy: Any = None) -> tuple[int, str]:
        """Its samples' slots (``Task.kv_tokens``): ``strategy.width`` generations' (the prompt's
        shared prefix cache is not counted: a sample's slot holds the prompt too)."""
        tokens, kind = Generation.kv_tokens(model, prompt_len, max_new_tokens)
        return strategy.width * tokens, kind

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], cfg: StrategyConfig, max_new_tokens: int,
                 params: SamplingParams, method: "MethodConfig", stop: list[str] | None = None) -> None:
        super().__init__(runner, prompt_ids, cfg, max_new_tokens, temperature=params.temperature, seed=params.seed)
        if params.temperature <= 0:
            raise InvalidParameterError(f"strategy {cfg.strategy!r} samples: give a temperature > 0")
        self.params, self.method, self.stop = params, method, list(stop or [])
        self.n: int = cfg.width
        self.members: list[Member] = []
        self._ended: dict[int, int] = {}
        self.prompt_text = runner.model.tokenizer.decode(prompt_ids)
        self.forwards = 0  # batched decoding forwards (the prompt's prefill not counted)
        self._work: list[tuple[Member, Forward]] = []  # this round's (sample, forward), between the halves

    # ------------------------------------------------------------ subclass API
    def after_round(self) -> bool:
        """Called after each round: reject samples, or return True to stop now."""
        return False

    def waiting(self, m: Member) -> bool:
        """True: leave the running sample ``m`` out of this round (it waits for the others)."""
        return False

    def end_position(self, m: Member) -> int:
        """Tokens decided when the finished sample ``m`` ended: through its end-of-sequence token,
        through the token that completed a stop string, or all of them (the token limit)."""
        if m.index in self._ended:
            return self._ended[m.index]
        scored = m.scored_tokens()
        pos = len(scored)
        if m.gen.result.finish_reason == "stop" and not (scored and scored[-1] in self.eos):
            pos = len(m.emitted)  # a stop string: the first prefix whose text holds one
            tok = self.model.tokenizer
            for j in range(len(scored) + 1, len(m.emitted) + 1):
                if any(s in tok.decode(m.emitted[:j]) for s in self.stop):
                    pos = j
                    break
        self._ended[m.index] = pos
        return pos

    def sample(self, m: Member, upto: int | None = None) -> Sample:
        """Sample ``m`` as a scorer sees it: finished, or its first ``upto`` emitted tokens."""
        if upto is None and m.done and not m.rejected:
            tokens = m.scored_tokens()
            res = m.gen.result
            return Sample(m.index, self.prompt_text, res.text, tokens, float(sum(m.logprobs[: len(tokens)])), True,
                          res.finish_reason)
        tokens = m.emitted[: len(m.emitted) if upto is None else upto]
        shown = [t for t in tokens if t not in self.model.eos_token_ids]
        return Sample(m.index, self.prompt_text, self.model.tokenizer.decode(shown), tokens,
                      float(sum(m.logprobs[: len(tokens)])), False, None)

    def hyp(self, m: Member, score: float, **info: Any) -> Hypothesis:
        """Sample ``m`` as a hypothesis; ``info["stop_string"]``: it ended on a stop string (its tokens
        then end without an end-of-sequence token)."""
        s = self.sample(m)
        if s.finish_reason == "stop" and not (s.tokens and s.tokens[-1] in self.eos):
            info["stop_string"] = True
        return Hypothesis(list(s.tokens), s.text, float(score), s.logprob, s.finish_reason or "length",
                          {"sample": m.index, **info})

    # ------------------------------------------------------------ life cycle (the task protocol: core/task.py)
    def _round_forwards(self) -> "list[Forward] | StepOutput":
        """Every live sample's next forward (each on its own cache: one batch, with other tasks' on a
        server); the first step (``_start``) started the samples and prefilled the prompt."""
        self._work = []
        for m in self.members:
            if not m.live or self.waiting(m):
                continue
            nxt = m.gen.next_forwards()
            if isinstance(nxt, StepOutput):
                continue  # it ended without a forward (no room left)
            self._work.append((m, nxt[0]))
        if not self._work:
            return self._round_done()
        return [f for _, f in self._work]

    def finish_forwards(self, forwards: "list[Forward]", logits: "list[torch.Tensor]") -> StepOutput:
        """Each sample's verification of its forward, then the round's end (``after_round``)."""
        try:
            work, self._work = self._work, []
            self.forwards += 1
            for (m, f), lg in zip(work, logits):
                before = len(m.gen.tokens)
                m.gen.finish_forwards([f], [lg])
                new = m.gen.tokens[before:]
                if new:
                    rows = _path_rows(f.tree, new)
                    lp = torch.log_softmax(lg[0, rows].float(), dim=-1)
                    m.logprobs.extend(lp[torch.arange(len(new)), torch.tensor(new)].tolist())
                    m.emitted.extend(new)
            return self._round_done()
        except BaseException:
            self.abort()
            raise

    def _round_done(self) -> StepOutput:
        if self.after_round() or not any(m.live for m in self.members):
            self._finish("done")
        return self._output()

    def _start(self) -> None:
        """The N generations; the first prefills the prompt, the others copy its keys and values."""
        seeds = sample_seeds(self.seed, self.n)
        for i, s in enumerate(seeds):
            params = SamplingParams(self.params.temperature, self.params.top_k, self.params.top_p, self.params.min_p,
                                    self.params.typical_p, self.params.repetition_penalty, s)
            proposer = build_proposer(self.method, self.runner)
            gen = Generation(self.runner, self.prompt_ids, params, proposer, method=self.method.method,
                             max_new_tokens=self.max_new_tokens, stop=self.stop, tree_budget=self.method.tree_budget,
                             memory_scope=self.memory_scope)
            self.members.append(Member(i, s, gen))
        lead = self.members[0].gen
        lead.start()
        end = len(self.prompt_ids) - 1
        k, v = lead.cache.committed_slice(0, end)
        for m in self.members[1:]:
            m.gen.adopt_prompt(k, v)
            m.gen.start()

    def reject(self, m: Member) -> None:
        """Stop sample ``m`` now (its cache goes back to the runner)."""
        m.rejected = True
        m.gen.close()

    def _finish(self, how: str) -> None:
        hyps = self.hypotheses() if how == "done" else []
        hyps = hyps[: self.cfg.returns]
        for m in self.members:
            if not m.gen.finished:
                m.gen.close()
        wall = time.perf_counter() - self._t0 if self._t0 else 0.0
        total = sum(len(m.emitted) for m in self.members)
        stats: dict[str, Any] = {"strategy": self.cfg.strategy, "method": self.method.method,
                                 "prompt_tokens": len(self.prompt_ids), "samples": len(self.members),
                                 "rounds": self.rounds, "target_forwards": self.forwards,
                                 "sampled_tokens": total, "prefix_reused": self._lead_reused(),
                                 "mean_accepted": round(total / max(1, sum(
                                     m.gen.result.stats.get("target_forwards", 0) for m in self.members
                                     if m.gen.result is not None)), 4),
                                 "wall_s": round(wall, 4)}
        stats.update(self.stats())
        if hyps:
            best = hyps[0]
            tokens = best.tokens[:-1] if best.finish_reason == "stop" and best.tokens and \
                best.tokens[-1] in self.eos else list(best.tokens)
            stats["new_tokens"] = len(tokens)
            stats["tokens_per_s"] = round(total / wall, 3) if wall > 0 else 0.0
            self.result = SearchResult(best.text, tokens, len(self.prompt_ids), best.finish_reason, stats, hyps)
        else:
            stats["new_tokens"] = 0
            self.result = SearchResult("", [], len(self.prompt_ids), "cancelled" if how != "done" else "stop",
                                       stats, [])

    def _lead_reused(self) -> int:
        res = self.members[0].gen.result if self.members else None
        return int(res.stats.get("prefix_reused", 0)) if res is not None else 0

    def abort(self) -> None:
        for m in self.members:
            m.gen.abort()
        if self.result is None:
            self.result = SearchResult("", [], len(self.prompt_ids), "error", {"strategy": self.cfg.strategy}, [])

    def release_more(self) -> None:
        for m in self.members:
            if not m.gen.finished:
                m.gen.close()
