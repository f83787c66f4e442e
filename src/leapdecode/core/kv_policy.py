"""KV-cache compression for long generations: lossy policies, off by default.

Every other part of leapdecode is exact; these are not.  A policy keeps fewer keys and values
than the sequence has (or stores them in fewer bits), so the model attends over an
approximation of its context and its output can change.  A generation runs without a policy
unless asked for one (``kv_policy=`` in the API, ``--kv-policy`` on the CLI,
``"leapdecode": {"kv_policy": ...}`` on the server); docs/lab-notes/benchmarks.md measures what each one
saves and what it costs in quality.

The policies, from the literature:

* ``streaming``: "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., 2023,
  StreamingLLM): the first ``sink`` tokens and the most recent ``window``.
* ``h2o``: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
  Models" (Zhang et al., 2023): every cached token accumulates the attention it receives (per
  layer and kv head, summed over the query heads that share it); the ``recent`` newest tokens
  and the heaviest hitters are kept, the lowest accumulated score is evicted when the cache
  holds more than ``budget``.
* ``snapkv``: "SnapKV: LLM Knows What You are Looking for Before Generation" (Li et al., 2024):
  once the prompt is in the cache, the attention of its last ``window`` queries (the
  observation window) over the earlier prompt positions, summed over the window, averaged over
  the query heads of a kv head and pooled along positions (``pool`` over ``kernel``), picks
  ``budget - window`` positions per kv head; the window is kept too.  Generated tokens are
  never evicted.
* ``scope``: "SCOPE: Optimizing Key-Value Cache Compression in Long-context Generation" (Wu et
  al., 2024; ACL 2025): separate budgets for the two phases.  The prompt is compressed once,
  SnapKV-style, to ``prefill`` tokens; the generated tokens are kept under their own ``decode``
  budget (the ``recent`` newest, and the heavy hitters among the older generated tokens by the
  attention that decoding queries paid them: the paper's sliding selection of decoding-phase
  heavy hitters); the compressed prompt is never touched during decoding.
* ``expected``: "Expected Attention: KV Cache Compression by Estimating Attention from Future
  Queries Distribution" (NVIDIA, 2025; kvpress's ``ExpectedAttentionPress``):
  the recent queries before rope (their mean ``mu`` and covariance ``S`` per query head, the
  first ``sink`` positions left out) are rotated by the average rope rotation of the next
  ``future`` positions; a key's expected attention is the softmax over keys of
  ``mu.k / sqrt(d) + k^T S k / (2d)``, averaged over the query heads of its kv head and
  multiplied by the norm of its value.  The ``sink`` first tokens are always kept; when the
  cache holds more than ``budget`` tokens, the lowest scores go (``step`` tokens at a time, so
  the scoring runs once per ``step`` generated tokens, as kvpress's ``DecodingPress``
  compresses every N steps).
* ``int8``: keys and values stored as int8 with one scale per (token, kv head), symmetric
  absmax (``models/kv_cache.py``'s ``Int8KVCache``), dequantized for attention: about half the
  bytes of a bf16 cache, a quarter of fp32.

How they run.  ``Generation`` (``core/generate.py``) asks the runner for a cache slot sized for
the policy (``KVPolicy.cache_tokens``: that is where the memory is saved, e.g. a long
generation under ``streaming:window=256`` takes a slot of about ``sink + window + 128``
instead of prompt + output), prefills the prompt in chunks of ``PREFILL_CHUNK`` tokens and
calls ``PolicyState.committed`` after every commit (prompt chunks and decoding steps).  The
policies that score by attention set the cache's ``observer``: the native decoder hands it each
layer's queries (``Block.attention``), and the state keeps those of the last forward; after a
commit it computes, for the committed queries only (a speculative step's rejected tree nodes
do not count), their attention over the committed keys.  Eviction (``KVCache.keep``) only
touches committed tokens, never pending tree nodes, so every speculative method works on a
compressed cache (its tree is verified against the compressed context).  Tokens keep their
original positions (``KVCache.pos_offset``: keys are stored after rope; see
``models/kv_cache.py``).  Invariants of every policy: the newest committed token is always
kept, and all kept slots stay in their original order.

Speculation under a policy: a step's tree is verified against the compressed cache and the
policy runs after the step's commit, so the tokens one step commits all attended to the cache as
it was before the step (and to each other).  The output under a policy therefore depends on how
many tokens each step commits: a speculative method's output can differ from vanilla's under the
same policy, and where tree sizes follow measured timings (``auto``, cost-aware trees) it can
differ between runs.  Vanilla decoding under a policy is deterministic, and so is the batched
engine's (``forward_batch`` gives each sequence its solo bits with the default kernels).

A generation with a policy never reads or writes the runner's prefix cache (its keys and
values are not the exact ones), and the HF backend does not support policies.  The state of a
policy (scores, query buffers) belongs to the generation, never to the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from ..errors import InvalidParameterError
from ..models.native import apply_rope

if TYPE_CHECKING:
    from ..models.kv_cache import KVCache
    from ..models.loader import LoadedModel

PREFILL_CHUNK = 128  # prompt tokens per prefill forward of a generation with a policy


def _opt(default: Any, help: str, *, low: int | None = None, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "low": low, "choices": choices})


@dataclass(frozen=True)
class KVPolicy:
    """Base of the policy configs: frozen, validated on construction (``InvalidParameterError``)."""

    name: ClassVar[str] = "base"
    cache_kind: ClassVar[str] = "plain"
    paper: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            where = f"kv_policy {self.name!r}: {f.name!r}"
            kind = type(f.default)
            if kind is bool:
                if not isinstance(value, bool):
                    raise InvalidParameterError(f"{where} must be true or false, got {value!r}")
            elif kind is int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidParameterError(f"{where} must be an integer, got {value!r}")
                low = f.metadata.get("low")
                if low is not None and value < low:
                    raise InvalidParameterError(f"{where} must be >= {low}, got {value}")
            else:
                choices = f.metadata.get("choices")
                if choices is not None and value not in choices:
                    raise InvalidParameterError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
        self.check()

    def check(self) -> None:
        """Constraints across fields (raise ``InvalidParameterError``)."""

    def fail(self, message: str) -> None:
        raise InvalidParameterError(f"kv_policy {self.name!r}: {message}")

    # ----------------------------------------------------------------- names
    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def options_table(cls) -> list[tuple[str, str, str]]:
        return [(f.name, str(f.default).lower() if isinstance(f.default, bool) else str(f.default),
                 f.metadata.get("help", "")) for f in dataclasses.fields(cls)]

    def spec(self) -> str:
        """The canonical string of this config (``parse_kv_policy(c.spec()) == c``)."""
        parts = [f"{f.name}={str(getattr(self, f.name)).lower() if isinstance(f.default, bool) else getattr(self, f.name)}"
                 for f in dataclasses.fields(self)]
        return self.name + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.spec()

    # ----------------------------------------------------------------- sizes
    def kept_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        """The most committed tokens the cache holds after the policy has run (between steps)."""
        return prompt_len + max_new_tokens

    def cache_tokens(self, prompt_len: int, max_new_tokens: int, margin: int) -> int:
        """Slots a generation needs: what the policy keeps, plus a prefill chunk or a step's tree
        (``margin``) on top before the policy runs again."""
        full = prompt_len + max_new_tokens + margin
        return min(full, self.kept_tokens(prompt_len, max_new_tokens) + max(margin, PREFILL_CHUNK))

    # ----------------------------------------------------------------- state
    def start(self, model: "LoadedModel", cache: "KVCache") -> "PolicyState":
        return STATES[type(self)](self, model, cache)


@dataclass(frozen=True)
class StreamingConfig(KVPolicy):
    name: ClassVar[str] = "streaming"
    paper: ClassVar[str] = "Efficient Streaming Language Models with Attention Sinks (Xiao et al., 2023)"
    sink: int = _opt(4, "first tokens always kept (attention sinks)", low=0)
    window: int = _opt(256, "most recent tokens kept", low=1)

    def kept_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(prompt_len + max_new_tokens, self.sink + self.window)


@dataclass(frozen=True)
class H2OConfig(KVPolicy):
    name: ClassVar[str] = "h2o"
    paper: ClassVar[str] = ("H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language "
                            "Models (Zhang et al., 2023)")
    needs_queries: ClassVar[bool] = True
    budget: int = _opt(256, "most tokens kept (heavy hitters + recent)", low=2)
    recent: int = _opt(32, "newest tokens always kept (part of the budget)", low=1)

    def check(self) -> None:
        if self.recent >= self.budget:
            self.fail(f"recent ({self.recent}) must be smaller than budget ({self.budget})")

    def kept_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(prompt_len + max_new_tokens, self.budget)


@dataclass(frozen=True)
class SnapKVConfig(KVPolicy):
    name: ClassVar[str] = "snapkv"
    paper: ClassVar[str] = "SnapKV: LLM Knows What You are Looking for Before Generation (Li et al., 2024)"
    needs_queries: ClassVar[bool] = True
    budget: int = _opt(256, "prompt tokens kept (observation window included)", low=2)
    window: int = _opt(32, "observation window: the last prompt queries, whose tokens are kept", low=1)
    kernel: int = _opt(7, "pooling kernel along positions (odd)", low=1)
    pool: str = _opt("max", "pooling: max or avg", choices=("max", "avg"))

    def check(self) -> None:
        if self.window >= self.budget:
            self.fail(f"window ({self.window}) must be smaller than budget ({self.budget})")
        if self.kernel % 2 == 0:
            self.fail(f"kernel must be odd, got {self.kernel}")

    def kept_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(prompt_len, self.budget) + max_new_tokens

    def cache_tokens(self, prompt_len: int, max_new_tokens: int, margin: int) -> int:
        return prompt_first_cache_tokens(self, prompt_len, max_new_tokens, margin)


def prompt_first_cache_tokens(policy: KVPolicy, prompt_len: int, max_new_tokens: int, margin: int) -> int:
    """Slots for a policy that compresses the prompt once it is whole (SnapKV, SCOPE): the whole
    prompt is in the cache before it is compressed."""
    full = prompt_len + max_new_tokens + margin
    return min(full, max(prompt_len, policy.kept_tokens(prompt_len, max_new_tokens)) + margin)


@dataclass(frozen=True)
class ScopeConfig(KVPolicy):
    name: ClassVar[str] = "scope"
    paper: ClassVar[str] = ("SCOPE: Optimizing Key-Value Cache Compression in Long-context Generation "
                            "(Wu et al., 2024)")
    needs_queries: ClassVar[bool] = True
    prefill: int = _opt(256, "prompt tokens kept (SnapKV-style, observation window included)", low=2)
    decode: int = _opt(128, "generated tokens kept (heavy hitters + recent)", low=2)
    recent: int = _opt(32, "newest generated tokens always kept (part of decode)", low=1)
    window: int = _opt(32, "prompt observation window (part of prefill)", low=1)
    kernel: int = _opt(7, "pooling kernel along prompt positions (odd)", low=1)
    pool: str = _opt("max", "pooling: max or avg", choices=("max", "avg"))

    def check(self) -> None:
        if self.window >= self.prefill:
            self.fail(f"window ({self.window}) must be smaller than prefill ({self.prefill})")
        if self.recent >= self.decode:
            self.fail(f"recent ({self.recent}) must be smaller than decode ({self.decode})")
        if self.kernel % 2 == 0:
            self.fail(f"kernel must be odd, got {self.kernel}")

    def kept_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(prompt_len, self.prefill) + min(max_new_tokens + 1, self.decode)

    def cache_tokens(self, prompt_len: int, max_new_tokens: int, margin: int) -> int:
        return prompt_first_cache_tokens(self, prompt_len, max_new_tokens, margin)


@dataclass(frozen=True)
class ExpectedAttentionConfig(KVPolicy):
    name: ClassVar[str] = "expected"
    paper: ClassVar[str] = ("Expected Attention: KV Cache Compression by Estimating Attention from Future "
                            "Queries Distribution (NVIDIA, 2025; kvpress)")
    needs_queries: ClassVar[bool] = True
    budget: int = _opt(256, "most tokens kept", low=2)
    sink: int = _opt(4, "first tokens always kept (and left out of the query statistics)", low=0)
    future: int = _opt(512, "future positions the query statistics are rotated to (averaged)", low=1)
    queries: int = _opt(128, "recent queries the statistics are estimated from", low=1)
    step: int = _opt(16, "tokens evicted at once (scoring runs once per step tokens)", low=1)
    cov: bool = _opt(True, "use the covariance of the queries (not only their mean)")
    vnorm: bool = _opt(True, "multiply the expected attention by the norm of the value")

    def check(self) -> None:
        if self.sink + self.step >= self.budget:
            self.fail(f"sink + step ({self.sink} + {self.step}) must be smaller than budget ({self.budget})")

    def kept_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(prompt_len + max_new_tokens, self.budget)


@dataclass(frozen=True)
class Int8Config(KVPolicy):
    name: ClassVar[str] = "int8"
    cache_kind: ClassVar[str] = "int8"
    paper: ClassVar[str] = "int8 KV cache: symmetric absmax per (token, kv head)"

    def cache_tokens(self, prompt_len: int, max_new_tokens: int, margin: int) -> int:
        return prompt_len + max_new_tokens + margin


POLICIES: dict[str, type[KVPolicy]] = {c.name: c for c in (StreamingConfig, H2OConfig, SnapKVConfig, ScopeConfig,
                                                             ExpectedAttentionConfig, Int8Config)}


def _parse_value(cls: type[KVPolicy], key: str, text: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[key]
    kind = type(f.default)
    if kind is bool:
        low = text.lower()
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
        raise InvalidParameterError(f"kv_policy {cls.name!r}: {key!r} must be true or false, got {text!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise InvalidParameterError(f"kv_policy {cls.name!r}: {key!r} must be an integer, got {text!r}") from None
    return text


def parse_kv_policy(spec: "str | KVPolicy | None") -> "KVPolicy | None":
    """A policy config from a spec string (``"streaming:sink=4,window=256"``, ``"h2o:budget=256,recent=32"``,
    ``"snapkv:budget=256"``, ``"scope:prefill=256,decode=128"``, ``"expected:budget=256"``, ``"int8"``),
    a config (returned as it is), or None / ``""`` / ``"none"`` (no policy)."""
    if spec is None or isinstance(spec, KVPolicy):
        return spec
    if not isinstance(spec, str):
        raise InvalidParameterError(f"kv_policy must be a spec string such as 'h2o:budget=256', got {spec!r:.80}")
    text = spec.strip()
    if text.lower() in ("", "none", "off"):
        return None
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidParameterError(f"unknown kv_policy {name!r}; choose from {', '.join(POLICIES)} "
                                    "(e.g. 'streaming:sink=4,window=256')")
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidParameterError(f"kv_policy {name!r}: options are KEY=VALUE, got {item!r}")
        if key not in cls.option_names():
            known = ", ".join(cls.option_names()) or "none"
            raise InvalidParameterError(f"kv_policy {name!r} has no option {key!r}; its options: {known}")
        if key in values:
            raise InvalidParameterError(f"kv_policy {name!r}: option {key!r} given twice")
        values[key] = _parse_value(cls, key, value.strip())
    return cls(**values)


def check_policy(policy: Any, model: Any) -> "KVPolicy | None":
    """``policy`` if a generation on ``model`` can run it: a policy config (or None), on the
    native backend (the policies hook its cache)."""
    if policy is None:
        return None
    if not isinstance(policy, KVPolicy):
        raise InvalidParameterError(f"kv_policy must be a KV-cache policy config (core/kv_policy.py), got "
                                    f"{type(policy).__name__}")
    if getattr(model, "backend", None) != "native":
        raise InvalidParameterError(f"kv_policy needs the native backend ({model.name} runs on "
                                    f"{getattr(model, 'backend', '?')!r})")
    return policy


# ---------------------------------------------------------------------------- scoring
def attention_probs(q: torch.Tensor, keys: torch.Tensor, first: int) -> torch.Tensor:
    """The attention of ``n`` queries over committed keys, as the model computed it: ``q``
    ``[Hq, n, D]`` (rope'd) for the tokens at slots ``first .. first + n - 1``, ``keys``
    ``[Hkv, L, D]``; query ``j`` sees slots ``< first + j + 1``.  Returns fp32
    ``[Hkv, G, n, L]`` (``G`` query heads per kv head)."""
    hq, n, d = q.shape
    hkv, length, _ = keys.shape
    g = hq // hkv
    s = torch.matmul(q.float().reshape(hkv, g, n, d), keys.float().transpose(-1, -2).unsqueeze(1)) / math.sqrt(d)
    visible = torch.arange(length, device=q.device)[None, :] < (first + 1 + torch.arange(n, device=q.device))[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1)


def pooled(scores: torch.Tensor, kernel: int, pool: str) -> torch.Tensor:
    """Scores ``[..., n]`` pooled along the last dimension (stride 1, same length)."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    x = scores.reshape(-1, 1, shape[-1])
    if pool == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return x.view(shape)


def top_slots(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """The ``k`` best positions along the last dimension, ascending (plus ``offset``)."""
    if k <= 0:
        return torch.empty(scores.shape[:-1] + (0,), dtype=torch.long, device=scores.device)
    idx = torch.topk(scores, k, dim=-1).indices
    return idx.sort(dim=-1).values + offset


def snapkv_slots(probs_window: torch.Tensor, prompt: int, budget: int, window: int, kernel: int,
                 pool: str) -> torch.Tensor:
    """SnapKV's selection for one layer: ``probs_window`` ``[Hkv, G, w, prompt]`` (the window's
    attention), returns the kept slots ``[Hkv, budget]`` (top pooled votes + the window)."""
    w = probs_window.shape[2]
    votes = probs_window[..., : prompt - w].sum(dim=2).mean(dim=1)  # [Hkv, prompt - w]
    votes = pooled(votes, kernel, pool)
    top = top_slots(votes, budget - w)
    tail = torch.arange(prompt - w, prompt, device=votes.device).expand(votes.shape[0], w)
    return torch.cat([top, tail], dim=-1)


class PolicyState:
    """What one generation's policy keeps between commits.  ``committed(nodes, phase)`` is called
    after every commit of the generation's cache: ``nodes`` are the pending nodes that were
    committed (their queries are in the last forward's stash), now the newest ``len(nodes)``
    committed slots; ``phase``: ``"prefill"`` (a prompt chunk), ``"prefill_end"`` (the last
    prompt chunk), ``"decode"`` (a decoding step)."""

    def __init__(self, policy: KVPolicy, model: "LoadedModel", cache: "KVCache") -> None:
        self.policy = policy
        self.cache = cache
        decoder = model.model
        self.cfg = decoder.cfg
        self.decoder = decoder
        self.n_layers = self.cfg.n_layers
        self.evictions = 0  # eviction passes
        self.evicted = 0  # tokens evicted
        self.peak = 0  # most committed tokens held after a commit, before eviction
        self.held = 0  # committed tokens held after the last commit and eviction
        self._stash: dict[int, tuple[int, torch.Tensor]] = {}
        if policy.needs_queries:
            cache.observer = self.observe

    def observe(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """The cache's observer: the queries of the forward that just wrote ``layer``."""
        self._stash[layer] = (self.cache.n_pending - q.shape[2], q)

    def queries(self, layer: int, nodes: list[int]) -> torch.Tensor | None:
        """The stashed queries ``[Hq, n, D]`` of the committed ``nodes`` at ``layer`` (None when
        the last forward of that layer did not carry them all)."""
        got = self._stash.get(layer)
        if got is None:
            return None
        start, q = got
        rows = [n - start for n in nodes]
        if not rows or min(rows) < 0 or max(rows) >= q.shape[2]:
            return None
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return q[0, :, rows[0] : rows[0] + len(rows)]
        return q[0, :, rows]

    @torch.inference_mode()
    def committed(self, nodes: list[int], phase: str) -> None:
        self.peak = max(self.peak, self.cache.length)
        self.update(list(nodes), phase)
        self._stash.clear()
        self.held = self.cache.length

    def update(self, nodes: list[int], phase: str) -> None:
        pass

    def evict_to(self, slots: torch.Tensor) -> None:
        before = self.cache.length
        self.cache.keep(slots)
        self.evictions += 1
        self.evicted += before - self.cache.length

    def stats(self) -> dict[str, Any]:
        """``kv_tokens``: tokens held at the end; ``kv_bytes``: their bytes; ``kv_slot_tokens`` and
        ``kv_slot_bytes``: the cache slot the generation used (possibly a reused, larger one)."""
        per = self.cache.bytes_per_slot
        return {"kv_policy": self.policy.spec(), "kv_evicted": self.evicted, "kv_peak_tokens": self.peak,
                "kv_tokens": self.held, "kv_bytes": self.held * per, "kv_slot_tokens": self.cache.max_len,
                "kv_slot_bytes": self.cache.nbytes}


class StreamingState(PolicyState):
    def update(self, nodes: list[int], phase: str) -> None:
        p, length = self.policy, self.cache.length
        if length <= p.sink + p.window:
            return
        dev = self.cache.device
        self.evict_to(torch.cat([torch.arange(p.sink, device=dev), torch.arange(length - p.window, length, device=dev)]))


class _AccumulatingState(PolicyState):
    """Accumulated attention per committed slot, layer and kv head (H2O's score)."""

    def __init__(self, policy: KVPolicy, model: "LoadedModel", cache: "KVCache") -> None:
        super().__init__(policy, model, cache)
        self.acc = torch.zeros(self.n_layers, self.cfg.n_kv_heads, cache.max_len, dtype=torch.float32,
                               device=cache.device)

    def accumulate(self, nodes: list[int]) -> None:
        cache, n = self.cache, len(nodes)
        length = cache.length
        first = length - n
        self.acc[:, :, first:length] = 0
        for layer in range(self.n_layers):
            q = self.queries(layer, nodes)
            if q is None:
                continue
            keys = cache.layer_kv(layer, length)[0][0]
            self.acc[layer, :, :length] += attention_probs(q, keys, first).sum(dim=(1, 2))

    def keep_with_scores(self, slots: torch.Tensor) -> None:
        n = slots.shape[-1]
        self.acc[:, :, :n] = self.acc[:, :, : self.cache.length].gather(2, slots)
        self.evict_to(slots)


class H2OState(_AccumulatingState):
    def update(self, nodes: list[int], phase: str) -> None:
        p, cache = self.policy, self.cache
        self.accumulate(nodes)
        length = cache.length
        if length <= p.budget:
            return
        older = length - p.recent
        heavy = top_slots(self.acc[:, :, :older], p.budget - p.recent)
        recent = torch.arange(older, length, device=cache.device).expand(self.n_layers, self.cfg.n_kv_heads, -1)
        self.keep_with_scores(torch.cat([heavy, recent], dim=-1))


class SnapKVState(PolicyState):
    """The observation window's queries are kept (per layer) while the prompt is prefilled; the
    prompt is compressed once, after its last chunk."""

    def __init__(self, policy: KVPolicy, model: "LoadedModel", cache: "KVCache") -> None:
        super().__init__(policy, model, cache)
        self.window_q: dict[int, torch.Tensor] = {}
        self.prompt_kept = 0  # prompt tokens in the cache after the compression (slots [0, prompt_kept))
        self.compressed = False

    @property
    def prompt_budget(self) -> int:
        return self.policy.budget

    def update(self, nodes: list[int], phase: str) -> None:
        if phase == "decode":
            if not self.compressed:  # a one-token prompt: no prefill, nothing to compress
                self.finish_prompt(self.cache.length - len(nodes))
            self.decode_update(nodes)
            return
        w = self.policy.window
        for layer in range(self.n_layers):
            q = self.queries(layer, nodes)
            if q is None:
                continue
            prev = self.window_q.get(layer)
            q = q if prev is None else torch.cat([prev, q], dim=1)
            self.window_q[layer] = q[:, -w:].clone()
        if phase == "prefill_end":
            self.compress_prompt()

    def compress_prompt(self) -> None:
        p, cache = self.policy, self.cache
        prompt = cache.length
        budget = self.prompt_budget
        if prompt > budget and len(self.window_q) == self.n_layers:
            w = min(p.window, prompt - 1, min(q.shape[1] for q in self.window_q.values()))
            slots = []
            for layer in range(self.n_layers):
                q = self.window_q[layer][:, -w:]
                keys = cache.layer_kv(layer, prompt)[0][0]
                probs = attention_probs(q, keys, prompt - w)
                slots.append(snapkv_slots(probs, prompt, budget, w, p.kernel, p.pool))
            self.evict_to(torch.stack(slots))
        self.finish_prompt(cache.length)

    def finish_prompt(self, prompt_kept: int) -> None:
        self.compressed = True
        self.prompt_kept = prompt_kept
        self.window_q.clear()
        if type(self) is SnapKVState:
            self.cache.observer = None  # generated tokens are never evicted: nothing more to observe

    def decode_update(self, nodes: list[int]) -> None:
        pass


class ScopeState(SnapKVState):
    """SnapKV on the prompt (``prefill`` budget), then H2O-style heavy hitters among the
    generated tokens only (``decode`` budget, ``recent`` of them always kept)."""

    def __init__(self, policy: KVPolicy, model: "LoadedModel", cache: "KVCache") -> None:
        super().__init__(policy, model, cache)
        self.acc = torch.zeros(self.n_layers, self.cfg.n_kv_heads, cache.max_len, dtype=torch.float32,
                               device=cache.device)

    @property
    def prompt_budget(self) -> int:
        return self.policy.prefill

    def decode_update(self, nodes: list[int]) -> None:
        p, cache = self.policy, self.cache
        length = cache.length
        first = length - len(nodes)
        base = self.prompt_kept
        self.acc[:, :, first:length] = 0
        for layer in range(self.n_layers):
            q = self.queries(layer, nodes)
            if q is None:
                continue
            keys = cache.layer_kv(layer, length)[0][0]
            self.acc[layer, :, :length] += attention_probs(q, keys, first).sum(dim=(1, 2))
        if length - base <= p.decode:
            return
        older = length - p.recent
        heavy = top_slots(self.acc[:, :, base:older], p.decode - p.recent, offset=base)
        shape = (self.n_layers, self.cfg.n_kv_heads, -1)
        prompt = torch.arange(base, device=cache.device).expand(*shape)
        recent = torch.arange(older, length, device=cache.device).expand(*shape)
        slots = torch.cat([prompt, heavy, recent], dim=-1)
        n = slots.shape[-1]
        self.acc[:, :, :n] = self.acc[:, :, :length].gather(2, slots)
        self.evict_to(slots)


class ExpectedAttentionState(PolicyState):
    """A buffer of the recent committed queries before rope (per layer); when the cache passes
    the budget, every key is scored by the attention the average future query is expected to
    pay it, and the lowest go."""

    def __init__(self, policy: KVPolicy, model: "LoadedModel", cache: "KVCache") -> None:
        super().__init__(policy, model, cache)
        self.buf: dict[int, torch.Tensor] = {}
        d = self.cfg.head_dim
        half = d // 2
        rot = torch.zeros(d, d, dtype=torch.float32, device=cache.device)  # rotate_half as a matrix
        rot[:half, half:] = -torch.eye(half)
        rot[half:, :half] = torch.eye(half)
        self.rot = rot

    def update(self, nodes: list[int], phase: str) -> None:
        p, cache = self.policy, self.cache
        length = cache.length
        first = length - len(nodes)
        pos0 = first + cache.pos_offset  # the true position of the first committed node
        cos_t, sin_t = self.decoder.rope_cos, self.decoder.rope_sin
        for layer in range(self.n_layers):
            q = self.queries(layer, nodes)
            if q is None:
                continue
            pos = torch.arange(pos0, pos0 + q.shape[1], device=cache.device)
            keep = pos >= p.sink  # kvpress leaves the first (sink) positions out of the statistics
            if not bool(keep.any()):
                continue
            q, pos = q[:, keep].float(), pos[keep]
            pre = apply_rope(q, cos_t[pos].float(), -sin_t[pos].float())  # undo the rotation
            prev = self.buf.get(layer)
            pre = pre if prev is None else torch.cat([prev, pre], dim=1)
            self.buf[layer] = pre[:, -p.queries :].clone()
        if length <= p.budget:
            return
        target = p.budget - p.step + 1
        slots = torch.stack([self.select(layer, length, target) for layer in range(self.n_layers)])
        self.evict_to(slots)

    def future_rotation(self, next_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The average rope cos and sin (``[D]``) over the next ``future`` positions."""
        table = self.decoder.rope_cos.shape[0]
        pos = torch.arange(next_pos, next_pos + self.policy.future, device=self.cache.device).clamp(max=table - 1)
        return self.decoder.rope_cos[pos].float().mean(0), self.decoder.rope_sin[pos].float().mean(0)

    def scores(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Expected attention of ``keys`` (``[Hkv, n, D]``) times their values' norms: ``[Hkv, n]``."""
        p, cache = self.policy, self.cache
        hkv, n, d = keys.shape
        g = self.cfg.n_heads // hkv
        buf = self.buf.get(layer)
        if buf is None or buf.shape[1] == 0:
            mu = torch.zeros(self.cfg.n_heads, d, device=keys.device)
            cov = None
        else:
            mu = buf.mean(dim=1)  # [Hq, D]
            cov = None
            if p.cov:
                c = buf - mu[:, None]
                cov = c.transpose(1, 2) @ c / buf.shape[1]  # [Hq, D, D]
        cos, sin = self.future_rotation(cache.length + cache.pos_offset)
        mu = apply_rope(mu, cos, sin)
        k = keys.float().repeat_interleave(g, dim=0)  # [Hq, n, D]
        z = (k @ mu.unsqueeze(-1)).squeeze(-1) / math.sqrt(d)
        if cov is not None:
            r = torch.diag(cos) + torch.diag(sin) @ self.rot  # the average rotation, as a matrix
            cov = r @ cov @ r.T
            z = z + ((k @ cov) * k).sum(-1) / (2 * d)
        s = torch.softmax(z, dim=-1).view(hkv, g, n).mean(dim=1)
        if p.vnorm:
            s = s * values.float().norm(dim=-1)
        return s

    def select(self, layer: int, length: int, target: int) -> torch.Tensor:
        p, cache = self.policy, self.cache
        k, v = cache.layer_kv(layer, length)
        sink = min(p.sink, length)
        s = self.scores(layer, k[0, :, sink:], v[0, :, sink:])
        s[:, -1] = float("inf")  # the newest token stays
        hkv = s.shape[0]
        sinks = torch.arange(sink, device=cache.device).expand(hkv, -1)
        return torch.cat([sinks, top_slots(s, target - sink, offset=sink)], dim=-1)


class Int8State(PolicyState):
    pass


STATES: dict[type[KVPolicy], type[PolicyState]] = {
    StreamingConfig: StreamingState, H2OConfig: H2OState, SnapKVConfig: SnapKVState, ScopeConfig: ScopeState,
    ExpectedAttentionConfig: ExpectedAttentionState, Int8Config: Int8State,
}


def policies_markdown() -> str:
    """The option table of every policy (docs/methods.md)."""
    out = []
    for name, cls in POLICIES.items():
        out.append(f"#### `{name}`: {cls.paper}\n")
        rows = cls.options_table()
        if not rows:
            out.append("No options.\n")
            continue
        out.append("| option | default | meaning |\n|---|---|---|")
        out.extend(f"| `{o}` | `{d}` | {h} |" for o, d, h in rows)
        out.append("")
    return "\n".join(out)
