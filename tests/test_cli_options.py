"""CLI method options: ``--option KEY=VALUE`` is typed by the method's config and checked before any
model loads; a mistake is one line on stderr and exit status 2."""

import subprocess
import sys

import pytest

from leapdecode import cli, cli_args
from leapdecode.models import loader


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loader, "load", refuse)


@pytest.mark.parametrize("argv, named", [
    (["--method", "draft", "--option", "bogus=1"], "bogus"),
    (["--method", "pld", "--option", "max_ngram=x"], "max_ngram"),
    (["--method", "pld", "--option", "max_ngram=0"], "max_ngram"),
    (["--method", "sam", "--option", "occurrence=middle"], "occurrence"),
    (["--method", "pld", "--option", "novalue"], "KEY=VALUE"),
    (["--method", "pld", "--draft", "smollm2-135m"], "draft"),
    (["--method", "pld", "--datastore", "x.npz"], "datastore"),
    (["--method", "draft", "--tree-budget", "0"], "tree_budget"),
])
def test_bad_option_exits_2_naming_it_before_loading(no_loading, capsys, argv, named):
    rc = cli.main(["generate", "-m", "smollm2-135m", *argv, "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("leapdecode: error:") and named in err


def test_option_values_are_typed_by_the_config():
    from leapdecode.proposers import method_config

    a = cli.build_parser().parse_args(["generate", "--method", "draft", "--option", "max_depth=3",
                                       "--option", "adaptive=false", "--option", "context_window=none",
                                       "--option", "tau=0.1", "--draft", "tiny-random:1", "hi"])
    opts = cli_args.method_options(a)
    assert opts == {"max_depth": 3, "adaptive": False, "context_window": None, "tau": 0.1, "draft": "tiny-random:1"}
    cfg = method_config("draft", opts)
    assert (cfg.max_depth, cfg.adaptive, cfg.context_window, cfg.draft) == (3, False, None, "tiny-random:1")


def test_sampling_top_k_is_not_the_draft_top_k():
    a = cli.build_parser().parse_args(["generate", "--method", "draft", "--top-k", "5", "--option", "top_k=2", "hi"])
    request = cli_args.decoding_request(a)
    assert request.sampling.top_k == 5 and request.method.top_k == 2


def test_cli_bogus_option_in_a_fresh_process():
    """The issue's own command: exit 2, one line naming the option (in a subprocess, as a user runs it)."""
    p = subprocess.run([sys.executable, "-m", "leapdecode.cli", "generate", "-m", "smollm2-135m", "--method", "draft",
                        "--option", "bogus=1", "hi"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "bogus" in lines[0], p.stderr


def test_methods_command_lists_every_method(capsys):
    from leapdecode.proposers import METHODS

    assert cli.main(["methods", "--markdown"]) == 0
    out = capsys.readouterr().out
    for name in METHODS:
        assert f"### `{name}` options" in out


def test_max_new_tokens_is_capped_at_the_context(capsys):
    """A huge --max-new-tokens is not an error (nor a huge allocation): it stops at the context."""
    import json

    from leapdecode.models.tiny import tiny_loaded

    rc = cli.main(["generate", "-m", "tiny-random", "--dtype", "fp32", "--method", "vanilla",
                   "--max-new-tokens", str(10**12), "--json", "hi"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    ctx = tiny_loaded().max_seq_len
    assert out["finish_reason"] in ("length", "stop")
    assert len(out["tokens"]) + 2 <= ctx  # prompt "hi" is 2 byte tokens


def test_chat_keeps_the_conversation_and_reports_what_the_prefix_cache_gave(monkeypatch, capsys):
    """``leapdecode chat --stats``: each reply goes back into the conversation, and on a model that
    prefills cut-invariantly (forced: a CPU with AMX would not) the second turn's prompt (over 64
    tokens: whole 256-token chunks only, before) restores blocks the first turn kept."""
    import io
    import re

    from leapdecode.models import kernel_library
    from leapdecode.models.native import NativeCausalLM

    if kernel_library.kernel_problem() is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {kernel_library.kernel_problem()}")
    monkeypatch.setattr(NativeCausalLM, "prefill_cut_invariant", property(lambda self: self.cut_invariant_tokens > 0))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand then?\n\n"))
    rc = cli.main(["chat", "-m", "tiny-random", "--weights", "int4", "--method", "pld", "--max-new-tokens", "40",
                   "--stats"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.count("bot> ") == 2
    stats = re.findall(r"\[(\d+) tokens, .* (\d+) of (\d+) prompt tokens from the prefix cache\]", captured.err)
    assert len(stats) == 2, captured.err
    (new1, reused1, prompt1), (_, reused2, prompt2) = [tuple(map(int, s)) for s in stats]
    assert reused1 == 0 and int(new1) == 40
    assert prompt2 > max(prompt1, 64) and 16 <= reused2 <= prompt2 - 1 and reused2 % 16 == 0


def test_every_front_end_loads_the_model_flags_the_same_way(monkeypatch):
    """``LoadOptions``: the model flags of ``generate``, ``bench`` and ``bench --quality`` as the
    loader's keywords, one set (its defaults the flags' defaults)."""
    from leapdecode.bench.cli import config_from_args
    from leapdecode.cli_args import LoadOptions

    parser = cli.build_parser()
    assert LoadOptions.from_args(parser.parse_args(["generate", "hi"])) == LoadOptions()
    flags = ["--dtype", "fp32", "--weights", "int8", "--attention", "invariant", "--device", "cpu",
             "--backend", "native", "--require-exact"]
    want = LoadOptions(dtype="fp32", weights="int8", attention="invariant", device="cpu", backend="native",
                       require_exact=True)
    assert config_from_args(parser.parse_args(["bench", *flags])).load_options == want
    seen = []
    monkeypatch.setattr(loader, "load", lambda model, **kw: seen.append((model, kw)) or "loaded")
    assert cli_args.load_from_args(parser.parse_args(["generate", "-m", "tiny-random", *flags, "hi"])) == "loaded"
    assert seen == [("tiny-random", {"dtype": "fp32", "weights": "int8", "attention": "invariant", "device": "cpu",
                                     "backend": "native", "require_exact": True})]
