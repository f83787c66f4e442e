"""Structured output: JSON schemas, regular expressions and grammars, compiled by llguidance.

The grammar engine is **llguidance** (Microsoft's Rust engine behind Guidance, also used by vLLM,
SGLang and llama.cpp): ``compile_constraint`` turns a JSON schema, a regex or a Lark grammar into a
``GrammarConstraint``, the ``core.constraint.Constraint`` the generation loop applies at every
verified tree row.  Why llguidance and not xgrammar (measured with ``scripts/grammar_engines.py``,
figures in docs/lab-notes/benchmarks.md): both compute a token mask in about 0.1 ms here, but xgrammar
*accepts* schemas whose keywords it does not implement and then produces JSON that does not
validate, while llguidance refuses them with an error naming the keyword; its compile time is
also milliseconds where xgrammar took seconds on some SchemaStore schemas.  A clear error beats
an invalid answer: outputs of supported schemas must validate, always.

Errors are ``GrammarError`` (an ``InvalidParameterError``: CLI exit 2, server 400): an invalid JSON
schema (checked against its metaschema with ``jsonschema`` first), a schema keyword llguidance does
not implement, an invalid regex or grammar, or a compile that exceeds its limits (llguidance's
parser limits bound the work; a wall-clock bound catches the rest).

Grammars: Lark syntax as llguidance reads it (``start: ...``; ``%json {...}`` embeds a schema); a
GBNF grammar (llama.cpp's format, recognised by ``::=``) is converted with llguidance's own
converter.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from ..core.constraint import Constraint
from ..core.prompt import check_text
from ..core.proposer import Identity, MemoryKey
from ..errors import GrammarError, InvalidParameterError, MissingExtraError

COMPILE_TIMEOUT_S = 10.0  # wall-clock bound on compiling one grammar
# whitespace allowed between JSON tokens: any JSON whitespace, but a bounded run of it, so that a
# model cannot loop on blank lines forever (small models do); deep pretty-printing still fits
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise MissingExtraError(
            "structured output needs llguidance: pip install 'leapdecode[structured]'") from None
    return llguidance


class GrammarConstraint(Constraint):
    """An llguidance matcher over the target's vocabulary.  The tokenizer's end-of-sequence token
    stands for all of the model's EOS tokens: they are allowed exactly when the grammar may end."""

    def __init__(self, matcher, vocab_size: int, eos_ids: set[int], grammar_eos: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = sorted(t for t in eos_ids if 0 <= t < vocab_size)
        self.grammar_eos = grammar_eos

    def fork(self) -> "GrammarConstraint":
        """An independent copy in the same state (another generation under the same grammar)."""
        return GrammarConstraint(self.matcher.deep_copy(), self.vocab_size, set(self.eos_ids), self.grammar_eos)

    def mask(self) -> torch.Tensor:
        raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(raw, bitorder="little")[: self.vocab_size].view(np.bool_)  # a fresh array
        if self.eos_ids:
            bits[self.eos_ids] = bool(bits[self.grammar_eos]) if self.grammar_eos < self.vocab_size else False
        return torch.from_numpy(bits)

    def allows(self, token: int) -> bool:
        if token in self.eos_ids:
            return self.matcher.is_accepting()
        return self.matcher.validate_tokens([token]) == 1

    def push(self, token: int) -> None:
        """Advance the grammar by ``token`` (one its mask allowed).  A grammar the engine compiled but
        cannot follow (a huge repetition such as ``a{1000000}`` hits the lexer's or parser's limits
        only while generating: probes SO025-SO040, HR11, HR17, HR19) is a ``GrammarError``: the
        request's fault, a 400, never an internal error."""
        if not self.matcher.consume_token(token):
            detail = " ".join(self.matcher.get_error().replace("<non-verbose/>", " ").split())[:300]
            raise GrammarError(f"the grammar engine hit one of its limits while generating ({detail}); simplify "
                               "the grammar (e.g. smaller repetition counts)")

    def pop(self, n: int = 1) -> None:
        if n and not self.matcher.rollback(n):
            raise RuntimeError(f"grammar could not roll back {n} tokens: {self.matcher.get_error()}")

    def forced(self, limit: int) -> list[int]:
        if limit <= 0:
            return []
        return list(self.matcher.compute_ff_tokens()[:limit])

    def is_eos(self, token: int) -> bool:
        return token in self.eos_ids

    @property
    def done(self) -> bool:
        """The grammar accepts what was generated (the output is complete)."""
        return self.matcher.is_accepting()


CHECKED_SCHEMAS = 256  # schemas remembered as valid (by content), so a schema is checked once


class _Checked:
    """The digests of schemas found valid (least recently used out), shared by every caller: a
    server checks a request's schema once, in a child process (``isolated.SchemaChecker``), and its
    validation and compilation then find it here instead of checking it again."""

    def __init__(self) -> None:
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._digests:
                self._digests.move_to_end(digest)
                return True
            return False

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
            while len(self._digests) > CHECKED_SCHEMAS:
                self._digests.popitem(last=False)


CHECKED = _Checked()


def schema_digest(schema: Any) -> bytes:
    """A digest of a schema's content (canonical JSON: key order does not matter)."""
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except RecursionError:  # probes SO016, SO017, PA36: 2,000 nested levels
        raise GrammarError("the JSON schema is nested too deeply to check") from None
    except (TypeError, ValueError) as e:
        raise GrammarError(f"a JSON schema must be JSON data: {e}") from None
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def read_json_schema(schema: Any) -> Any:
    """A JSON schema as data (a mapping or a boolean) from itself or its JSON text, and the checks
    that need no metaschema: ``true`` is ``{}``; ``false`` and anything but an object are refused."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError("the JSON schema is nested too deeply to read") from None
    if schema is False:  # probe SO013: was the engine's "Unimplemented keys: ['not']", a key never written
        raise GrammarError("the JSON schema is `false`: it accepts no document at all")
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return schema


def check_json_schema(schema: Any, against_metaschema: Callable[[dict], None] | None = None) -> dict:
    """A JSON schema (a mapping, or its JSON text) checked against its metaschema (once per content:
    ``CHECKED``), by ``against_metaschema`` (raises a ``GrammarError``; default: jsonschema here,
    ``metaschema_check``; a server's runs it in a child process, ``isolated.SchemaChecker``)."""
    schema = read_json_schema(schema)
    digest = schema_digest(schema)
    if digest in CHECKED:
        return schema
    (against_metaschema or metaschema_check)(schema)
    CHECKED.add(digest)
    return schema


def metaschema_check(schema: dict) -> None:
    """jsonschema's check of ``schema`` against its metaschema, in this process (a ``GrammarError``)."""
    try:
        import jsonschema
    except ImportError:
        raise MissingExtraError("JSON schemas need jsonschema: pip install 'leapdecode[structured]'") from None
    try:
        # structure only: no format checks, since JSON Schema's patterns are ECMA-262 regexes that
        # Python's re may not read (named groups "(?<name>...)"); the grammar engine judges those
        jsonschema.validators.validator_for(schema).check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid JSON schema at {where}: {e.message}") from None
    except RecursionError:  # probes SO016, SO017, PA36: 2,000 nested levels
        raise GrammarError("the JSON schema is nested too deeply to check") from None


def grammar_text(*, json_schema: Any = None, regex: str | None = None, grammar: str | None = None) -> str:
    """llguidance's grammar for exactly one of a JSON schema, a regex or a Lark/GBNF grammar."""
    given = [n for n, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) != 1:
        raise InvalidParameterError(f"give one of json_schema, regex, grammar (got {', '.join(given) or 'none'})")
    ll = _llguidance()
    if json_schema is not None:
        schema = check_json_schema(json_schema)
        try:
            return ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                         defaults={"whitespace_pattern": JSON_WHITESPACE})
        except ValueError as e:
            raise GrammarError(f"JSON schema not supported: {e}") from None
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise GrammarError(f"regex must be a non-empty string, got {regex!r:.80}")
        return ll.LLMatcher.grammar_from_regex(check_text(regex, "the regex"))
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError(f"grammar must be a non-empty string, got {grammar!r:.80}")
    check_text(grammar, "the grammar")
    if "::=" in grammar:  # GBNF (llama.cpp): llguidance converts it to its Lark dialect
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as e:  # the converter's own error types
            raise GrammarError(f"invalid GBNF grammar: {e}") from None
    return ll.LLMatcher.grammar_from_lark(grammar)


def tokenizer_key(model) -> MemoryKey:
    """The runner-memory key of llguidance's view of ``model``'s tokenizer: the tokenizer by
    identity (``Identity``, held weakly: a freed tokenizer's successor at its address is another
    key; a bare ``id()`` could name either).  transformers' tokenizers (and ``tokenizers``' own
    ``Tokenizer``) can be weakly referenced; one that cannot is keyed by the ``LoadedModel`` that
    owns it instead (a plain class, always weakly referenceable).  No scope: the view is derived
    from the tokenizer (and the vocabulary size of the runner's one model) alone, the same for
    every memory scope, so it is kept once."""
    try:
        of = Identity(model.tokenizer)
    except TypeError:  # not weakly referenceable
        of = Identity(model)
    return MemoryKey("grammar", "tokenizer", of=of)


def grammar_tokenizer(runner):
    """llguidance's view of the target's tokenizer (built once per runner: ~0.4 s)."""
    model = runner.model

    def build():
        ll = _llguidance()
        tok = model.tokenizer
        try:
            return ll.hf.from_tokenizer(tok, n_vocab=model.model.vocab_size)
        except ValueError as e:
            raise GrammarError(f"structured output needs a fast (Rust) tokenizer; {model.name}: {e}") from None

    return runner.memory.get(tokenizer_key(model), build)


def compile_constraint(runner, *, json_schema: Any = None, regex: str | None = None, grammar: str | None = None,
                       timeout_s: float = COMPILE_TIMEOUT_S) -> GrammarConstraint:
    """A fresh ``GrammarConstraint`` for one generation on ``runner``'s target."""
    text = grammar_text(json_schema=json_schema, regex=regex, grammar=grammar)
    ll = _llguidance()
    tok = grammar_tokenizer(runner)
    out: dict[str, Any] = {}

    def build() -> None:
        try:
            out["matcher"] = ll.LLMatcher(tok, text, log_level=0, limits=ll.LLParserLimits(verbose_errors=False))
        except Exception as e:  # noqa: BLE001  (reported below as a GrammarError)
            out["error"] = e

    worker = threading.Thread(target=build, name="grammar-compile", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise GrammarError(f"the grammar took more than {timeout_s:g} s to compile; simplify it")
    if "error" in out:
        raise GrammarError(f"cannot compile the grammar: {out['error']}")
    matcher = out["matcher"]
    if matcher.is_error():
        # the engine's message, without the backtrace (and build paths) of an internal panic (probe HR21)
        raw = matcher.get_error().split("<backtrace>", 1)[0]
        detail = " ".join(raw.split())[:400] or "unknown error"
        if detail.startswith("panic: "):
            raise GrammarError("the grammar engine failed on it, probably because it is too large (an internal "
                               f"limit: {detail.removeprefix('panic: ')}); simplify it")
        raise GrammarError(f"the grammar engine refused it: {detail}")
    matcher.compute_bitmask()  # the first mask tells whether anything can be generated at all
    if matcher.is_stopped() and not matcher.is_accepting():
        raise GrammarError("the grammar matches nothing (its language is empty)")
    model = runner.model
    eos = tok.eos_token if isinstance(getattr(tok, "eos_token", None), int) else model.tokenizer.eos_token_id
    return GrammarConstraint(matcher, model.model.vocab_size, set(model.eos_token_ids), int(eos))

