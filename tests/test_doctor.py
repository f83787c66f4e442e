"""``leapdecode doctor`` and ``require_exact`` (issue 44 items 5 and 6): the report, its invariance
check, and a machine without a compiler on an empty cache (exactness lost, said and enforced)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import leapdecode
from leapdecode import doctor
from leapdecode.cli import main
from leapdecode.errors import ExactnessError
from leapdecode.models import kernel_library
from leapdecode.models.invariance import QUICK_CASES, TREE, CHAIN, configuration_problem


def test_report_matches_the_machine(capsys):
    assert main(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["threads"] == torch.get_num_threads() and r["kernel"]["problem"] == kernel_library.kernel_problem()
    assert r["kernel"]["library"].endswith(".so") and r["cache"]["writable"] is True
    assert set(r["cpu"]["flags"]) <= set(doctor.FLAGS)
    assert r["default"]["rows_checked"] == len(QUICK_CASES) * (len(TREE) + len(CHAIN))
    assert r["exact"] == (r["default"]["problem"] is None and r["default"]["rows_differing"] == 0)
    if kernel_library.kernel_problem() is None:  # the default configuration here: int4 blocks, invariant attention
        assert r["kernel"]["isa"] == kernel_library.kernel_isa() and r["kernel"]["built"] and r["kernel"]["intact"]
        assert (r["default"]["weights"], r["default"]["attention"]) == ("int4", "invariant") and r["exact"]
        assert main(["doctor", "--strict"]) == 0
        assert "✓ exact speculation      guaranteed" in capsys.readouterr().out
    assert {"server", "structured", "bench"} <= set(r["extras"])


def test_the_invariance_check_sees_a_forward_that_depends_on_its_rows(monkeypatch):
    # a model whose logits move by 1e-3 whenever a forward holds more than one token: the check
    # measures the difference, and the report says exactness is not guaranteed
    from leapdecode.models import loader

    real_load = loader.load

    def load_skewed(*args, **kwargs):
        lm = real_load(*args, **kwargs)
        forward = lm.model.forward

        def skewed(tokens, cache, *a, **k):
            out = forward(tokens, cache, *a, **k)
            return out + 1e-3 if tokens.shape[1] > 1 else out

        monkeypatch.setattr(lm.model, "forward", skewed)
        return lm

    monkeypatch.setattr(loader, "load", load_skewed)
    check = doctor.invariance_check()
    assert check["rows_differing"] == check["rows_checked"]  # every tree row differs


def test_configuration_problems_name_the_cause():
    cpu = torch.device("cpu")
    assert "transformers backend" in configuration_problem(False, cpu, "int4", "invariant")
    assert "float weights" in configuration_problem(True, cpu, None, "invariant")
    assert "attention sdpa" in configuration_problem(True, cpu, "int8", "sdpa")
    assert "cuda" in configuration_problem(True, torch.device("cuda"), "int4", "invariant")
    assert configuration_problem(True, cpu, "int8", "invariant") is None


def test_require_exact_refuses_a_configuration_that_is_not_invariant(capsys):
    with pytest.raises(ExactnessError, match="float weights"):
        leapdecode.load("tiny-random", require_exact=True)  # not a GGUF: float weights, sdpa
    with pytest.raises(ExactnessError, match="attention sdpa"):
        leapdecode.load("tiny-random", weights="int8", attention="sdpa", require_exact=True)
    assert leapdecode.load("tiny-random", weights="int8", require_exact=True).model.attention == "invariant"
    assert main(["generate", "-m", "tiny-random", "--max-new-tokens", "2", "--require-exact", "hi"]) == 2
    assert "error: exactness is not guaranteed: float weights" in capsys.readouterr().err


@pytest.mark.integration
def test_no_compiler_on_an_empty_cache_is_said_and_enforced(tmp_path):
    # the done-when of issue 44: PATH without compilers, an empty model cache
    env = {**os.environ, "PATH": str(tmp_path / "no-bin"), "LEAPDECODE_CACHE": str(tmp_path / "cache")}
    env.pop("CXX", None)
    env.pop("LEAPDECODE_REQUIRE_KERNEL", None)  # (CI's: here the kernel's absence is the point)

    def leapdecode_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "leapdecode.cli", *args], env=env, capture_output=True,
                              text=True, timeout=600)

    doc = leapdecode_cli("doctor", "--strict", "--json")
    assert doc.returncode == 1, doc.stderr
    r = json.loads(doc.stdout)
    assert r["compiler"] is None and r["kernel"]["problem"].startswith("no C++ compiler found") and not r["exact"]
    assert "no C++ compiler found" in r["default"]["problem"]
    gen = leapdecode_cli("generate", "-m", "smollm2-135m", "--max-new-tokens", "4", "Hello")
    assert gen.returncode == 0, gen.stderr
    warnings = [line for line in gen.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "the exact int4 kernel cannot run here (no C++ compiler found" in warnings[0]
    strict = leapdecode_cli("generate", "-m", "smollm2-135m", "--max-new-tokens", "4", "--require-exact", "Hello")
    assert strict.returncode == 2
    assert strict.stderr.strip().splitlines()[-1] == (
        "leapdecode: error: exactness is not guaranteed: float weights: their matrix products are not "
        "batch-invariant (the exact path is int4 on leapdecode's kernel); the exact int4 kernel cannot run "
        "here: no C++ compiler found (set CXX or install g++)")


def test_doctor_says_whether_a_model_runs_natively_and_in_its_files_blocks(tmp_path, monkeypatch, capsys,
                                                                          cache_with_kernel):
    """Issue 63: ``doctor MODEL`` answers before loading: the architecture on the native decoder or
    not (and why), every block type of the GGUF in its own blocks or re-quantized, exact here or not."""
    import gguf
    import transformers

    from leapdecode.models.support import support_of
    from tiny_gguf import write_gguf

    monkeypatch.setenv("LEAPDECODE_CACHE", str(cache_with_kernel(tmp_path / "cache")))
    cfg = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_hidden_layers=1, max_position_embeddings=64)
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).eval()
    good = write_gguf(qwen3, tmp_path / "q8.gguf")
    s = support_of(str(good))
    assert (s.architecture, s.native, s.requantized, s.types) == ("Qwen3ForCausalLM", None, [], {"Q8_0": 1.0})
    assert s.exact == (kernel_library.kernel_problem() is None)
    half = support_of(str(write_gguf(qwen3, tmp_path / "f16.gguf", gguf.GGMLQuantizationType.F16)))
    assert half.native is None and half.requantized == ["F16"]
    assert any(label == "weights" and "F16 re-quantized" in text and not fine for label, text, fine in half.lines())
    # an architecture the native decoder does not run: the transformers backend, not exact, and why
    other = tmp_path / "qwen2-windowed"  # Qwen2's windowed layers are not on the native decoder
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg, use_sliding_window=True, sliding_window=32)
                                  ).save_pretrained(other)
    g = support_of(str(other))
    assert g.architecture == "Qwen2ForCausalLM" and "sliding-window" in g.native and not g.exact
    # the command: the model's lines under the machine's, --json with the same answer, --strict fails for the windowed Qwen2
    assert main(["doctor", str(good), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"]["exact"] == s.exact and r["model"]["architecture"] == "Qwen3ForCausalLM"
    assert main(["doctor", str(other), "--strict"]) == 1
    out = capsys.readouterr().out
    assert f"model {other}" in out and "✗ architecture" in out and "transformers backend" in out
