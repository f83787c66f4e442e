"""The generation loop: propose -> verify -> commit -> update the proposer.

It is the same loop for every method.  Vanilla decoding is the case where there is no
proposer, so every step verifies just the root and emits the target's next token.
End-of-sequence, stop strings and the token limit act on committed tokens only.

A ``Generation`` holds one sequence's state: its KV cache (a slot the runner hands out for the
generation's lifetime, so generations in flight never share one), its proposer, its random
generator and its text.  ``step()`` runs one iteration and returns what it decided; a batched
scheduler calls it, and iterating a ``Generation`` calls it until the sequence finishes.

This module knows proposers only through the interface of ``core/proposer.py``; which method
builds which proposer is decided a layer up (``leapdecode.api``, ``leapdecode.proposers``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch
from jinja2 import TemplateError, TemplateSyntaxError

from ..errors import InvalidParameterError, ModelFileError, PromptTooLongError
from .constraint import Constraint, RowMasks, extend_forced, prune_tree, unprune
from .cost_model import synchronize
from .output import OutputProcessor
from .kv_policy import KVPolicy, PolicyState
from .prefill import PrefillPlanner, prefill_chunk
from .proposer import DecodeContext, Proposer
from .sampling import SamplingParams
from .task import Forward, Status, StepOutput, Task
from .tree import TokenTree
from .verifier import Verdict, verify

if TYPE_CHECKING:
    from .runner import ModelRunner

TREE_MARGIN = 128  # cache slots reserved beyond the output for the last step's tree


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled", "error" (abort())
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "stats": self.stats}


def cache_tokens(model, prompt_len: int, max_new_tokens: int, kv_policy: KVPolicy | None = None) -> int:
    """Tokens a generation asks its KV-cache slot to hold: the prompt, the output and the margin
    for the last step's tree (the runner rounds it up: ``runner.slot_len``); with a KV-cache
    policy, what the policy keeps plus a prefill chunk or a tree (``KVPolicy.cache_tokens``)."""
    if kv_policy is not None:
        return min(model.max_seq_len, kv_policy.cache_tokens(prompt_len, max_new_tokens, TREE_MARGIN))
    return min(model.max_seq_len, prompt_len + max_new_tokens + TREE_MARGIN)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # every front end's (the server's too)


def _check_message(m: Any, i: int) -> None:
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise InvalidParameterError(f"message {i} must be a {{'role': ..., 'content': ...}} mapping, got {m!r:.80}")
    if m["role"] not in CHAT_ROLES:  # probe PA29: an unknown role went into the template
        raise InvalidParameterError(f"message {i}: 'role' must be one of {', '.join(CHAT_ROLES)}, "
                                    f"got {m['role']!r:.80}")
    if not isinstance(m["content"], str):
        raise InvalidParameterError(f"message {i}: 'content' must be a string, got {type(m['content']).__name__}")


def check_text(text: str, what: str) -> str:
    """``text`` if it can be encoded as UTF-8; an ``InvalidParameterError`` naming ``what`` and the
    position for a lone surrogate (a JSON ``"\ud800"``, or bytes that are not UTF-8 handed over
    as surrogate escapes by the command line: probes HS23, G071-G074, C02, C09, PA30, PA31)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(f"{what} is not valid UTF-8 text (an unpaired surrogate or an undecodable "
                                    f"byte at character {e.start})") from None
    return text


def encode_prompt(model, prompt, chat: bool | None = None, tools: list[dict] | None = None) -> list[int]:
    """A string (plain, or as one user message with ``chat=True``) or a list of chat messages.
    ``tools``: function definitions (OpenAI's ``{"type": "function", "function": {...}}``) for a
    chat template that reads ``tools``."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        else:
            ids = tok.encode(prompt)
            if not ids:
                raise InvalidParameterError("the prompt is empty")
            return ids
    if not isinstance(prompt, list):
        raise InvalidParameterError(
            f"prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}")
    if not prompt:
        raise InvalidParameterError("the message list is empty")
    for i, m in enumerate(prompt):
        _check_message(m, i)
        check_text(m["content"], f"message {i}'s content")
    if not getattr(tok, "chat_template", None):
        raise InvalidParameterError(f"model {model.name} has no chat template; pass a plain string prompt")
    extra = {}
    if tools:
        if "tools" not in str(tok.chat_template):
            raise InvalidParameterError(f"model {model.name}'s chat template does not support tools")
        extra["tools"] = tools
    try:
        out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **extra)
    except TemplateSyntaxError as e:  # probe F24: a broken chat_template.jinja was a traceback
        raise ModelFileError(f"model {model.name}'s chat template is broken ({e}); pass a plain string prompt, "
                             "or repair the model's chat_template") from None
    except TemplateError as e:  # the template's own raise_exception: these messages are not allowed
        raise InvalidParameterError(f"model {model.name}'s chat template refused these messages: {e}") from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def check_max_new_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(f"max_new_tokens must be an integer >= 1, got {value!r}")
    return value


def check_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
        raise InvalidParameterError(f"stop must be a non-empty string or a list of them, got {stop!r:.80}")
    for s in stops:
        check_text(s, "a stop string")
    return list(stops)


class Generation(Task):
    """One generation on a runner (a ``Task``: ``core/task.py``); iterate for text pieces as they are decided, or call
    ``step()``; then read ``.result``.  ``close()`` (called at the end, and by ``cancel`` when
    iteration stops) gives the KV cache back to the runner."""

    def __init__(
        self,
        runner: "ModelRunner",
        prompt_ids: list[int],
        params: SamplingParams,
        proposer: Proposer | None = None,
        method: str = "vanilla",
        max_new_tokens: int = 256,
        stop: list[str] | None = None,
        tree_budget: int | None = None,
        kv_policy: KVPolicy | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        model = runner.model
        self.runner = runner
        self.model = model
        self.params = params
        self.method = method
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.stop = check_stop(stop)
        if not prompt_ids:
            raise InvalidParameterError("the prompt is empty")
        self.prompt_ids = list(prompt_ids)
        if len(self.prompt_ids) + 1 > model.max_seq_len:
            raise PromptTooLongError(
                f"prompt has {len(self.prompt_ids)} tokens; the context of {model.name} holds "
                f"{model.max_seq_len} (prompt + at least 1 new token)"
            )
        if kv_policy is not None:
            if not isinstance(kv_policy, KVPolicy):
                raise InvalidParameterError(f"kv_policy must be a KV-cache policy config (core/kv_policy.py), got "
                                            f"{type(kv_policy).__name__}")
            if getattr(model, "backend", None) != "native":
                raise InvalidParameterError(f"kv_policy needs the native backend ({model.name} runs on "
                                            f"{getattr(model, 'backend', '?')!r})")
        self.kv_policy = kv_policy  # lossy KV-cache compression (core/kv_policy.py); None: exact
        self._kv: PolicyState | None = None
        self.proposer = proposer
        self.constraint = constraint  # a grammar the output must follow (core/constraint.py)
        self.tree_budget = (tree_budget or proposer.default_budget) if proposer is not None else 0
        self.result: GenerationResult | None = None
        self._cancelled = False
        self._started = False
        self._closed = False
        self.cache = None

    # -------------------------------------------------------------- control
    def cancel(self) -> None:
        """Stop at the next step (e.g. the client went away)."""
        self._cancelled = True

    @property
    def finished(self) -> bool:
        return self.result is not None

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def __iter__(self) -> Iterator[str]:
        try:
            while self.result is None:
                out = self.step()
                if out.text:
                    yield out.text
        finally:
            if self.result is None:  # the consumer stopped iterating early
                self._finish("cancelled")

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Take a cache slot from the runner, prefill the prompt (all but its last token, which is
        the first step's root) and start the proposer.  ``step()`` calls it when needed."""
        self._begin()
        while self.prefilling:
            work = self._next_prefill()
            if work is not None:
                self.finish_forward(work, work.run(self.model.model, self.cache))
        self._ready()

    def _begin(self) -> None:
        """The cache slot, the random generator and the prefill plan (no forward yet)."""
        if self._started:
            return
        self._started = True
        model, target, params = self.model, self.model.model, self.params
        self._t_start = time.perf_counter()
        self.generator = gen = torch.Generator(device=target.device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        ids = self.prompt_ids
        policy = self.kv_policy
        if policy is None:
            self.cache = cache = self.runner.acquire_cache(model, cache_tokens(model, len(ids), self.max_new_tokens))
        else:
            self.cache = cache = self.runner.acquire_cache(
                model, cache_tokens(model, len(ids), self.max_new_tokens, policy), kind=policy.cache_kind)
            self._kv = policy.start(model, cache)
        self.ctx = DecodeContext(self.runner, cache, params, gen, len(ids), self.max_new_tokens)
        # the prompt but its last token, in chunks aligned to position 0, through the prefix cache
        self.prefill = PrefillPlanner(self.runner, cache, ids, policy)
        self._ready_done = False

    def adopt_prompt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Start from a prompt another generation already prefilled: ``k``, ``v`` are the keys and
        values of this prompt's tokens but its last (``KVCache.committed_slice`` of that generation's
        cache after its prefill), copied into this generation's cache instead of computing them.
        Exact: a prefill is the same position-0-aligned chunks wherever it runs, so the copy holds
        the bits this generation would have computed.  Before the first step, without a KV policy."""
        if self._started:
            raise RuntimeError("adopt_prompt must come before the generation starts")
        if self.kv_policy is not None:
            raise InvalidParameterError("a generation with a kv_policy prefills its own prompt")
        if k.shape[3] != len(self.prompt_ids) - 1:
            raise ValueError(f"{k.shape[3]} prompt slots given for a prompt of {len(self.prompt_ids)} tokens "
                             "(all but the last)")
        self._begin()
        if k.shape[3]:
            self.cache.append_committed(k, v)
        self.prefill.adopt(k.shape[3])

    @property
    def status(self) -> Status:
        if self.result is not None:
            return Status.FINISHED
        if not self._started:
            return Status.WAITING
        return Status.PREFILLING if self.prefilling else Status.DECODING

    @property
    def decoding(self) -> bool:
        """Started, prompt prefilled, not finished: its next forward is a decoding step."""
        return self._started and self.result is None and not self.prefilling

    @property
    def prefilling(self) -> bool:
        """Not finished, with prompt chunks still to run through the target (so before it started
        too, when the prompt has more than its root token)."""
        done = self.prefill.prefilled if self._started else 0
        return self.result is None and done < len(self.prompt_ids) - 1

    def next_chunk_tokens(self) -> int:
        """About how many prompt tokens this generation's next prefill forward computes (a cost
        model's guess: blocks the prefix cache restores are not looked up)."""
        if self._started:
            return self.prefill.next_tokens()
        return max(min(len(self.prompt_ids) - 1, prefill_chunk(self.model.model, self.kv_policy)), 0)

    def _next_prefill(self) -> "Forward | None":
        """The next prompt chunk to compute (``PrefillPlanner``); a proposer that reads the
        prompt's features gets the hidden states of its last tokens."""
        return self.prefill.next_forward(self.proposer.prompt_features() if self.proposer is not None else 0)

    def _ready(self) -> None:
        """After the prefill: the decoding state and the proposer (which may prefill its own)."""
        if self._ready_done:
            return
        self._ready_done = True
        model, params, cache = self.model, self.params, self.cache
        try:
            self._prefill_s = time.perf_counter() - self._t_start
            self.tokens = list(self.prompt_ids)  # decided so far; the last one is the root (not yet in the cache)
            self.generated: list[int] = []
            self.out = OutputProcessor(model.tokenizer, self.stop)  # text pieces, stop strings, statistics
            self._history = torch.tensor(self.tokens, device=model.device) if params.repetition_penalty != 1.0 else None
            if self.proposer is not None:
                if self.proposer.needs_verify_cost(params):
                    self.ctx.verify_cost = self.runner.verify_cost(cache)
                self.proposer.begin(self.ctx, self.tokens)
        except BaseException:
            self._release()
            raise

    # ----------------------------------------------------------------- step
    def step(self) -> StepOutput:
        """One propose -> verify -> commit iteration (the first call also prefills the prompt)."""
        if self.result is not None:
            return StepOutput("", [], True, self.result.finish_reason)
        try:
            self.start()
            work = self.next_forward()
            if isinstance(work, StepOutput):
                return work
            cost = self.ctx.verify_cost if work.tree is not None else None
            if cost is None or not cost.learn:
                return self.finish_forward(work, work.run(self.model.model, self.cache))
            # the measured profile learns from every step's forward (greedy tree sizes follow it)
            t0 = time.perf_counter()
            logits = work.run(self.model.model, self.cache)
            synchronize(logits.device)
            cost.observe(work.tokens.numel(), time.perf_counter() - t0)
            return self.finish_forward(work, logits)
        except BaseException:
            self._release()
            raise

    def next_forward(self, cap: int | None = None) -> "Forward | StepOutput":
        """The first half of a step, for a scheduler that batches the target's forwards: the next
        forward this generation needs (a prompt chunk, or the root and the proposer's tree; ``cap``
        bounds the tree's size), or a ``StepOutput`` when the generation ended without one.  Hand
        the forward's logits to ``finish_forward``; nothing else may touch the cache in between."""
        if self.result is not None:
            return StepOutput("", [], True, self.result.finish_reason)
        try:
            self._begin()
            if self._cancelled:
                return self._finish("cancelled")
            if self.prefilling:
                work = self._next_prefill()
                if work is not None:
                    return work
            self._ready()
            return self._plan_step(cap)
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------ the task protocol (core/task.py)
    streams = True  # its text is final as it is decided (stop strings held back)

    def next_forwards(self, cap: int | None = None) -> "list[Forward] | StepOutput":
        nxt = self.next_forward(cap)
        if isinstance(nxt, StepOutput):
            return nxt
        nxt.cache, nxt.decoder = self.cache, self.model.model
        return [nxt]

    def finish_forwards(self, forwards: "list[Forward]", logits: "list[torch.Tensor]") -> StepOutput:
        return self.finish_forward(forwards[0], logits[0])

    def _plan_step(self, cap: int | None) -> "Forward | StepOutput":
        cache, proposer = self.cache, self.proposer
        if cache.room() < 1:
            return self._finish("length")
        tokens = self.tokens
        remaining = self.max_new_tokens - len(self.generated)
        budget = min(self.tree_budget, cache.room() - 1, max(remaining - 1, 0))
        if cap is not None:
            budget = min(budget, max(cap, 0))
        t0 = time.perf_counter()
        constraint = self.constraint
        # where the grammar forces the next tokens, it drafts them itself (no proposer time)
        t_grammar = time.perf_counter()
        forced = constraint.forced(budget) if constraint is not None and proposer is not None and budget > 0 else []
        t_grammar = time.perf_counter() - t_grammar
        proposed = proposer is not None and budget > 0 and not forced  # observe() follows only a propose()
        if forced:
            tree = TokenTree.chain(forced, source="grammar")
        else:
            tree = proposer.propose(tokens, budget) if proposed else TokenTree()
        if cache.n_pending:
            raise RuntimeError(f"proposer {proposer.name!r} left {cache.n_pending} nodes pending in the target's "
                               "cache; a proposer must roll back what it appends")
        tree = tree.truncated(max(budget, 0))
        drafted, kept = tree, None
        if constraint is not None and len(tree):
            t1 = time.perf_counter()
            tree, kept = prune_tree(tree, constraint)
            if proposed and len(tree) < budget:  # what the grammar forces after the drafted path
                extended = tree if kept is not None else tree.copy()
                if extend_forced(extended, constraint, budget - len(tree)):
                    kept = kept if kept is not None else list(range(len(tree)))
                    tree = extended
            t_grammar += time.perf_counter() - t1
        self.out.constraint_s += t_grammar
        hidden = [] if proposed and proposer.wants_hidden() else None
        chain = all(p == i - 1 for i, p in enumerate(tree.parents))
        flat = torch.tensor([tokens[-1]] + tree.tokens, device=self.model.device)
        self.out.draft_s += time.perf_counter() - t0
        return Forward(flat, None if chain else tree.flattened_parents(), tree=tree, hidden=hidden,
                       t0=time.perf_counter(), proposed=proposed, drafted=drafted if kept is not None else None,
                       kept=kept)

    def finish_forward(self, work: "Forward", logits: torch.Tensor) -> StepOutput:
        """The second half of a step: ``logits`` (``[1, T, vocab]``) of ``work``'s forward."""
        try:
            if work.tree is None:  # a prompt chunk
                self.cache.commit()
                if work.hidden:
                    self.proposer.observe_prompt(self.prefill.prefilled, work.hidden)
                self.prefill.computed(work)
                if self._kv is not None:
                    self._kv.committed(range(work.tokens.numel()), "prefill" if self.prefilling else "prefill_end")
                return StepOutput("", [], False)
            return self._accept(work, logits[0])
        except BaseException:
            self._release()
            raise

    def _accept(self, work: "Forward", logits: torch.Tensor) -> StepOutput:
        cache, proposer, tree, hidden = self.cache, self.proposer, work.tree, work.hidden
        tokens, generated = self.tokens, self.generated
        masks = RowMasks(self.constraint, tree) if self.constraint is not None else None
        try:
            start, ctx = len(tokens), self.ctx
            uniform = (lambda depth: ctx.uniform(start + depth)) if ctx.drafter_invariant else None
            verdict = verify(tree, logits, self.params, self._history, self.generator, allowed=masks,
                             uniform=uniform)
        finally:
            if masks is not None:
                masks.close()
                self.out.constraint_s += masks.seconds
        path = [0] + [a + 1 for a in verdict.accepted]
        cache.commit(path)
        if self._kv is not None:
            self._kv.committed(path, "decode")
        self.out.verify_s += time.perf_counter() - work.t0
        self.out.count_step(len(tree), len(verdict.accepted))
        finish = None
        kept: list[int] = []
        for t in verdict.tokens:
            if t in self.model.eos_token_ids:
                finish = "stop"
                break
            if self.constraint is not None:
                t1 = time.perf_counter()
                self.constraint.push(t)
                self.out.constraint_s += time.perf_counter() - t1
            kept.append(t)
            if len(generated) + len(kept) >= self.max_new_tokens:
                finish = "length"
                break
        generated.extend(kept)
        self.out.decided += len(kept) + (finish == "stop")  # the end-of-sequence token was decided too
        tokens.extend(verdict.tokens)
        if self._history is not None:
            self._history = torch.tensor(tokens, device=self.model.device)
        if work.proposed and finish is None:
            t2 = time.perf_counter()
            if work.kept is not None:  # the grammar pruned the proposer's tree: its own numbering back
                accepted, logits, hidden = unprune(work.drafted, work.kept, verdict.accepted, logits, hidden)
                tree, verdict = work.drafted, Verdict(accepted, verdict.next_token, verdict.tokens)
            proposer.observe(tokens, tree, verdict, logits, hidden)
            self.out.draft_s += time.perf_counter() - t2
        shown = self.out.emit(kept, finish)
        if shown.covering is not None:  # a stop string: the output ends where its text does
            self.generated = shown.covering
        if shown.finish is not None:
            self._finish(shown.finish, shown.text)
            return StepOutput(shown.piece, kept, True, shown.finish)
        return StepOutput(shown.piece, kept, False)

    @property
    def draft_acceptance(self) -> float:
        """Draft tokens accepted per step that verified a tree, so far, with a weak prior (one
        token per step, worth two steps) so that a generation that has not drafted yet gets tried."""
        return self.out.draft_acceptance() if self._ready_done else 1.0

    # --------------------------------------------------------------- finish
    def _finish(self, reason: str, text: str | None = None) -> StepOutput:
        if self.result is not None:
            return StepOutput("", [], True, self.result.finish_reason)
        if not self._started:
            self.result = GenerationResult("", [], len(self.prompt_ids), reason, {"method": self.method})
            return StepOutput("", [], True, reason)
        if not self._ready_done:  # ended during the prefill (cancelled): the proposer never began
            self._release()
            self.result = GenerationResult("", [], len(self.prompt_ids), reason,
                                           {"method": self.method, "prefix_reused": self.prefill.reused})
            return StepOutput("", [], True, reason)
        try:
            if self.prefill.keep_output:
                # the cache's committed slots hold the keys and values of the tokens decided so far
                # (a bonus token at the end has none yet; slots past a stop are never read)
                self.prefill.keep_blocks(self.tokens, min(self.cache.length, len(self.tokens)))
            if self.proposer is not None:
                self.proposer.end()
        finally:
            self._release()
        if text is None:
            text = self.out.text
        stats = self.out.stats(method=self.method, new_tokens=len(self.generated), prompt_tokens=len(self.prompt_ids),
                               wall=time.perf_counter() - self._t_start, prefill_s=self._prefill_s,
                               prefix_reused=self.prefill.reused, constrained=self.constraint is not None)
        if self.proposer is not None:
            stats.update(self.proposer.stats())
        if self._kv is not None:
            stats.update(self._kv.stats())
        self.result = GenerationResult(text, list(self.generated), len(self.prompt_ids), reason, stats)
        return StepOutput("", [], True, reason)

    def abort(self) -> None:
        """Give the cache back after a failure that ends this generation (finish reason "error")."""
        self._release()  # the runner resets the cache it takes back
        if self.result is None:  # finished: a later step() or next_forward() does nothing
            self.result = GenerationResult("", list(getattr(self, "generated", [])), len(self.prompt_ids), "error",
                                           {"method": self.method})

    def close(self) -> None:
        """Give the cache back now (a generation abandoned before its end)."""
        if self.result is None:
            self._finish("cancelled")

    def _release(self) -> None:
        if self.cache is not None and not self._closed:
            self._closed = True
            self.ctx.release_all()
            self.runner.release_cache(self.cache)

    def __del__(self) -> None:  # an abandoned generation still returns its cache slot
        try:
            if self._started and not self._closed:
                self._release()
        except Exception:
            pass
