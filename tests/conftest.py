"""Shared fixtures: cached tiny random models, fresh runners, and a chi-square goodness-of-fit test.

Tiny models are built once per (seed, variant) for the whole session, so property
tests spend their time decoding, not initialising weights.  Every factory call
returns the *same* ``LoadedModel`` object for the same arguments; tests that need
a second, independent object with identical weights ask for ``copy=1`` (e.g. a
draft with the target's weights).

Models hold weights only; what decoding learns lives in a ``ModelRunner``.  The shared
models' runners forget it before every test (the suite runs in random order:
pytest-randomly), and a test whose thresholds depend on learned state or on measured
costs builds its own runner (``fresh_runner``, with ``verify_cost="flat"``).

The plain helpers that test files import (servers on loopback, tiny dLLMs, kernel variants, a
script loaded as a module, batch-invariant layers) live in tests/helpers/, not here.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

# The test models are tiny: every op costs microseconds and intra-op threads only add
# synchronisation.  On a loaded 2-core CI box two OpenMP threads made a tiny forward
# ~40x slower (spin-waiting) than one, so the suite runs single-threaded by default.
torch.set_num_threads(int(os.environ.get("LEAPDECODE_TEST_THREADS", "1")))


_SHARED_MODELS: list = []  # every model ``_tiny`` built: their runners' memory is cleared before each test


@functools.lru_cache(maxsize=None)
def _tiny(seed: int = 0, copy: int = 0, noise: float = 0.0, noise_seed: int = 0, layers: int = 2,
          hidden: int = 64, invariant: bool = False):
    """A tiny random ``LoadedModel`` (fp32, CPU, vocab 259, max_seq_len 2048).

    ``copy`` distinguishes otherwise identical objects; ``noise > 0`` adds Gaussian
    noise of that std to every weight (a draft that is close to, but not, the target);
    ``invariant``: batch-invariant (``make_batch_invariant``; the same weights, another object),
    for tests that compare speculative methods with vanilla bit for bit on many random cases.
    """
    from helpers.models import make_batch_invariant
    from leapdecode.models.tiny import tiny_loaded

    lm = tiny_loaded(name=f"tiny-random:{seed}", seed=seed, layers=layers, hidden=hidden,
                     heads=4, kv_heads=2)
    if noise > 0:
        g = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for p in lm.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    if invariant:
        make_batch_invariant(lm.model)
    _SHARED_MODELS.append(lm)
    return lm


@pytest.fixture(scope="session")
def tiny():
    """``tiny(seed=0, copy=0, noise=0.0, noise_seed=0, layers=2, hidden=64, invariant=False)`` ->
    cached LoadedModel."""
    return _tiny


@pytest.fixture(scope="session")
def cache_with_kernel():
    """``cache_with_kernel(path)``: make ``path`` a model cache holding this machine's verified kernel
    library (a copy: a subprocess on that cache runs no compiler); skips where the kernel cannot run."""
    import shutil
    from pathlib import Path

    from leapdecode.models import kernel_library, store

    problem = kernel_library.kernel_problem()
    if problem is not None:
        pytest.skip(f"no kernel here: {problem}")
    real = Path(kernel_library.kernel_status()["library"])

    def make(cache: Path) -> Path:
        (cache / "kernels").mkdir(parents=True)
        for f in (real, store.digest_path(real)):
            shutil.copy2(f, cache / "kernels" / f.name)
        return cache

    return make


@pytest.fixture(scope="session")
def q4_tiny():
    """``tiny-random`` on the int4 block kernel with the invariant attention: batch-invariant, so
    a sequence's greedy output in a batch is its solo output bit for bit (skipped where the kernel
    cannot build)."""
    from leapdecode.models import kernel_library

    problem = kernel_library.kernel_problem()
    if problem is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {problem}")
    from leapdecode.models.loader import load

    model = load("tiny-random", weights="int4")
    assert model.model.attention == "invariant"
    return model


@pytest.fixture(scope="session")
def trained_head_dir(tiny, tmp_path_factory):
    """``trained_head_dir(kind)``: the ``--out`` directory of a head of ``kind`` (medusa, hydra, eagle,
    eagle3) trained for a few seconds on ``tiny(seed=0)`` without EOS tokens (not installed; trained once
    per session, shared by test_heads.py and test_head_storage.py)."""
    import dataclasses

    from helpers.heads import train_tiny_head

    target = dataclasses.replace(tiny(seed=0), eos_token_ids=set())
    dirs: dict = {}

    def get(kind):
        if kind not in dirs:
            out = tmp_path_factory.mktemp(f"trained-{kind}") / "head"
            train_tiny_head(kind, target, out, steps={"eagle": 120, "eagle3": 60}.get(kind, 40), install_head=False)
            dirs[kind] = out
        return dirs[kind]

    return get


@pytest.fixture(autouse=True)
def _forget_what_shared_models_learned():
    """The cached tiny models are shared by the whole session, and so are their runners
    (``runner_for``): what a method learned on one in an earlier test (bandit statistics,
    acceptance calibration, n-gram pools) is forgotten before each test, so that no test
    depends on which tests ran before it (the suite runs in random order).  Tests whose
    thresholds depend on learned state or on measured costs use ``fresh_runner`` instead."""
    from leapdecode import runner_for

    for lm in _SHARED_MODELS:
        runner_for(lm).memory.clear()
    yield


@pytest.fixture(autouse=True)
def _no_bundled_heads(tmp_path_factory, monkeypatch):
    """The heads shipped in the package (``leapdecode/bundled_heads/``) are invisible to tests, as the
    user's model cache is (each test sets its own ``LEAPDECODE_CACHE``): a test sees the heads it
    writes.  tests/test_head_storage.py checks the package's own bundled heads separately."""
    from leapdecode.proposers.heads import store

    empty = tmp_path_factory.getbasetemp() / "no-bundled-heads"
    empty.mkdir(exist_ok=True)
    monkeypatch.setattr(store, "bundled_root", lambda: empty)


def flat_verify_cost():
    """A verification cost that does not grow with the tree: cost-aware methods draft all they can."""
    from leapdecode.core.cost_model import VerifyCost

    return VerifyCost([1, 64], [1.0, 1.0])


@pytest.fixture
def flat_cost():
    """``flat_verify_cost()`` (a ``VerifyCost``)."""
    return flat_verify_cost()


@pytest.fixture
def pessimistic_sizers(monkeypatch):
    """``pessimistic_sizers(module)`` -> a list that fills with the ``TreeSizer``s ``module`` (a
    drafter's module) creates from now on, each planted in a state where no deeper level can pay for
    itself (a forward of 10 s, a best child accepted 1% of the time)."""
    from leapdecode.proposers.tree_cost import TreeSizer

    def plant(module) -> list:
        made = []

        def pessimistic() -> TreeSizer:
            sizer = TreeSizer()
            sizer.forward_s, sizer.top_accept = 10.0, 0.01
            made.append(sizer)
            return sizer

        monkeypatch.setattr(module, "TreeSizer", pessimistic)
        return made

    return plant


@pytest.fixture
def fresh_runner():
    """``fresh_runner(model, verify_cost=None, drafts=None, **runner_kwargs)`` -> a new ``ModelRunner``
    (empty memory, no measured costs) for ``model``.

    ``verify_cost``: a ``VerifyCost`` (or ``"flat"``: ``flat_verify_cost()``) used instead of
    measuring the target (so thresholds do not depend on this machine's timings); ``drafts``:
    ``{name: LoadedModel}`` added with ``add_draft`` (options then name them: ``{"draft": name}``)."""
    from leapdecode import ModelRunner

    def make(model, verify_cost=None, drafts=None, **kwargs):
        runner = ModelRunner(model, **kwargs)
        if isinstance(verify_cost, str):
            assert verify_cost == "flat", verify_cost
            verify_cost = flat_verify_cost()
        if verify_cost is not None:
            runner.verify_cost = lambda cache, cost=verify_cost: cost
        for name, draft in (drafts or {}).items():
            runner.add_draft(name, draft)
        return runner

    return make


def chi2_gof(observed, expected_probs, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson chi-square goodness of fit of counts ``observed`` to probabilities ``expected_probs``.

    Bins with expected count below ``min_expected`` are merged (smallest first) into
    one pooled bin, the usual validity rule for the chi-square approximation.  Bins
    with expected probability 0 must be empty (an observation there is an immediate
    failure: p-value 0).  Returns (statistic, degrees of freedom, p-value); the
    p-value is the regularised upper incomplete gamma function Q(df/2, stat/2), i.e.
    the chi-square survival function (no scipy needed).
    """
    obs = torch.as_tensor(observed, dtype=torch.float64).flatten()
    p = torch.as_tensor(expected_probs, dtype=torch.float64).flatten()
    assert obs.shape == p.shape, (obs.shape, p.shape)
    assert abs(float(p.sum()) - 1.0) < 1e-6, float(p.sum())
    n = float(obs.sum())
    if bool(((p <= 0) & (obs > 0)).any()):
        return math.inf, 0, 0.0
    keep = p > 0
    obs, p = obs[keep], p[keep]
    exp = p * n
    order = torch.argsort(exp)
    pooled_o = pooled_e = 0.0
    bins_o, bins_e = [], []
    for i in order.tolist():
        if exp[i] < min_expected or (pooled_e > 0 and pooled_e < min_expected):
            pooled_o += float(obs[i])
            pooled_e += float(exp[i])
        else:
            bins_o.append(float(obs[i]))
            bins_e.append(float(exp[i]))
    if pooled_e > 0:
        if pooled_e < min_expected and bins_e:  # fold a still-too-small pool into the smallest bin
            bins_o[0] += pooled_o
            bins_e[0] += pooled_e
        else:
            bins_o.append(pooled_o)
            bins_e.append(pooled_e)
    o = torch.tensor(bins_o, dtype=torch.float64)
    e = torch.tensor(bins_e, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(bins_o) - 1
    if df < 1:
        return stat, 0, 1.0
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, pval


@pytest.fixture(scope="session")
def chi2():
    """``chi2(observed_counts, expected_probs, min_expected=5) -> (stat, df, p_value)``."""
    return chi2_gof


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: bad flags must be refused before a model is loaded."""
    from leapdecode.models import loader

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("a model was loaded before the flags were checked"))


# ------------------------------------------------------------------ tiers
# Every test is in exactly one tier (a marker, registered in pyproject.toml; `make test-TIER` runs one,
# `make test-fast` the unit tier, `make test` all).  A file's tests are in its tier below; a test listed
# in TEST_TIERS, or marked with a tier itself (``@pytest.mark.integration``), is in that tier instead.
# tests/test_tiers.py fails on a test file in no tier or in two.
TIERS = ("unit", "exactness", "kernels", "server", "integration")  # what each holds: pyproject.toml's markers
FILE_TIERS: dict[str, tuple[str, ...]] = {
    "unit": (
        "test_asap.py", "test_batch_stats.py", "test_cli_options.py", "test_config.py", "test_cost_model.py",
        "test_decoder_protocol.py", "test_detokenizer.py", "test_diffusion_apd.py", "test_diffusion_cli.py",
        "test_diffusion_elastic_cache.py", "test_diffusion_models.py", "test_diffusion_policies_c.py",
        "test_diffusion_train.py", "test_docs.py", "test_draft_ceiling.py", "test_generate.py", "test_hf_backend.py",
        "test_hostile_inputs.py", "test_kv_blocks.py", "test_kv_cache.py", "test_layering.py", "test_lookahead.py",
        "test_method_defaults.py", "test_models_list.py", "test_models_store.py", "test_output.py",
        "test_prefill.py", "test_reference.py", "test_registry.py", "test_request.py", "test_results_page.py",
        "test_runner.py", "test_running_mean.py", "test_scale_report.py", "test_static_step.py", "test_steps.py",
        "test_suffix.py", "test_tiers.py",
    ),
    "exactness": (
        "test_a_star.py", "test_auto_head.py", "test_contrastive.py", "test_diffusion_constrained.py",
        "test_diffusion_decoders.py", "test_diffusion_formats.py", "test_diffusion_s2d2.py", "test_eagle3.py",
        "test_head_storage.py", "test_heads.py", "test_hydra.py", "test_invariant_attention.py", "test_kv_policy.py",
        "test_layerskip.py", "test_look_back.py", "test_lossless.py", "test_model_free.py", "test_phi_decoding.py",
        "test_quant.py", "test_rest.py", "test_scaling.py", "test_strategies.py", "test_structured.py",
        "test_superposed.py", "test_universal_draft.py", "test_verifier.py",
    ),
    "kernels": (
        "test_architectures.py", "test_attention_kernel.py", "test_gguf_blocks.py", "test_gguf_model.py",
        "test_kernel_abi.py", "test_kernel_build.py", "test_kernel_cache.py", "test_layer_stack.py", "test_moe.py",
        "test_qkernel.py",
    ),
    "server": (
        "test_batch.py", "test_batch_gate.py", "test_ray_serve.py", "test_server.py", "test_task.py",
        "test_tenants.py", "test_tools.py",
    ),
    "integration": (
        "test_bench.py", "test_bench_quality.py", "test_cache_faults.py", "test_default_exact.py",
        "test_diffusion_bench.py", "test_doctor.py", "test_gpu_check.py", "test_head_prompt_mix.py",
        "test_head_training.py", "test_llama_server.py",
    ),
}
# slow tests of a faster tier's file, by "file::function" (every parametrization; measured 2026-12-06
# with --durations on 2 loaded cores: each took 3-20 s there)
TEST_TIERS: dict[str, str] = {
    "test_cli_options.py::test_cli_bogus_option_in_a_fresh_process": "integration",
    "test_generate.py::test_console_script_bad_input": "integration",
    "test_generate.py::test_seed_reproducibility": "exactness",
    "test_hostile_inputs.py::test_an_engine_panic_is_one_line_without_its_backtrace": "server",
    "test_hostile_inputs.py::test_a_grammar_the_engine_cannot_follow_is_a_grammar_error": "server",
    "test_runner.py::test_two_interleaved_streams_on_one_model_give_their_solo_outputs": "exactness",
    "test_static_step.py::test_every_method_gives_vanillas_tokens_through_the_static_step": "exactness",
}

def tier_of(file: str, function: str, marked: set[str]) -> str | None:
    """The tier of test ``function`` of ``file`` that carries the tier markers ``marked``: its own marker,
    else its entry in TEST_TIERS, else its file's tier (None: the file is in no tier)."""
    if len(marked) > 1:
        raise pytest.UsageError(f"{file}::{function} is marked with two tiers: {sorted(marked)}")
    if marked:
        return next(iter(marked))
    if f"{file}::{function}" in TEST_TIERS:
        return TEST_TIERS[f"{file}::{function}"]
    return next((tier for tier, files in FILE_TIERS.items() if file in files), None)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        marked = {m.name for m in item.iter_markers() if m.name in TIERS}
        tier = tier_of(item.path.name, item.originalname, marked)
        if tier is not None and not marked:
            item.add_marker(tier)


def pytest_ignore_collect(collection_path, config):
    """With ``-m TIER`` (one tier, alone), a test file with no test in that tier is not even imported:
    the unit tier's files import in seconds, the whole suite's in ~15 s of CPU."""
    tier = config.getoption("markexpr", "")
    if tier not in TIERS or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    name = collection_path.name
    if name in FILE_TIERS[tier] or any(k.split("::")[0] == name and v == tier for k, v in TEST_TIERS.items()):
        return None
    return f"mark.{tier}" not in collection_path.read_text(encoding="utf-8") or None
