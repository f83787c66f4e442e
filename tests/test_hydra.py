"""Hydra heads (issue 17): ``method="hydra"`` on tiny random models.

1. Greedy identity with vanilla (random heads, several budgets, a repetition penalty) and with a
   briefly trained head, which accepts more than a random one.
2. Sampling: the joint distribution of the first three tokens over many seeds against the exact one
   (chi-square, as tests/test_heads.py); a planted error (a recorded ``q`` that is not the one the
   children were drawn from) is caught by the same test.
3. The heads see the drafted path: two nodes of one depth under different parents get different
   children distributions (what Medusa's heads cannot do).
4. ``train-head --kind hydra`` from the CLI, ``heads list``, the typed errors.
"""

from __future__ import annotations

import json

import pytest
import torch

import leapdecode
from leapdecode import ModelRunner
from leapdecode.cli import main as cli_main
from leapdecode.core.sampling import SamplingParams
from leapdecode.errors import HeadMismatchError, HeadNotFoundError, InvalidParameterError
from leapdecode.proposers import METHODS
from leapdecode.proposers.heads.hydra import HydraHeads, HydraProposer
from leapdecode.proposers.heads.store import load_head
from helpers.heads import ALPHA, PROMPTS, TRAIN_TEXT, chi2_against, count_first_three, joint3, train_tiny_head, vanilla
from helpers.heads import random_hydra, write_hydra


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))


def gen(model, ids, head_dir, **kw):
    return leapdecode.generate(ModelRunner(model), prompt_ids=ids, method="hydra",
                               options={"head": str(head_dir), **kw.pop("options", {})}, **kw)


def test_registered_with_a_typed_config():
    cfg = METHODS["hydra"].config.from_options({"top_k": 3, "beam": 2, "tree_budget": 8})
    assert (cfg.top_k, cfg.beam, cfg.head) == (3, 2, None)
    for bad in ({"beam": 0}, {"top_k": 0}, {"heads": 2}):
        with pytest.raises(InvalidParameterError):
            METHODS["hydra"].config.from_options(bad)


def test_untrained_head_is_the_targets_next_token(tiny):
    """Hydra's initialisation: head ``i`` starts as the identity on the feature (as Medusa's)."""
    model = tiny(seed=0)
    head = HydraHeads.for_target(model, heads=3)
    f = torch.randn(5, model.model.cfg.hidden_size)
    for i in range(3):
        assert torch.allclose(head(i, f, torch.randn(5, i + 1, f.shape[-1])), f)
    with pytest.raises(InvalidParameterError):
        head(1, f, torch.randn(5, 1, f.shape[-1]))


# ============================================================================ greedy identity
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_identity_random_head(tiny, tmp_path, seed):
    model = tiny(seed=seed)
    head_dir = write_hydra(model, tmp_path / "hydra", seed=seed)
    tok = model.tokenizer
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        for budget, penalty, beam in ((None, 1.0, 4), (1, 1.0, 1), (5, 1.3, 2), (32, 0.8, 8)):
            n = 12 + 7 * i
            ref = vanilla(model, ids, max_new_tokens=n, repetition_penalty=penalty)
            opts = {"beam": beam, **({"tree_budget": budget} if budget else {})}
            out = gen(model, ids, head_dir, max_new_tokens=n, repetition_penalty=penalty, options=opts)
            assert out.tokens == ref.tokens, (prompt, budget, penalty)
            assert out.stats["target_forwards"] <= ref.stats["target_forwards"]


def test_trained_head_is_exact_and_accepts_more(tiny, tmp_path):
    model = tiny(seed=0)
    manifest = train_tiny_head("hydra", model, tmp_path / "trained", steps=60, install_head=False)
    assert manifest["kind"] == "hydra" and manifest["steps"] == 60 and manifest["config"]["heads"] == 3
    random_dir = write_hydra(model, tmp_path / "random")

    def mean_accepted(head_dir):
        new = forwards = 0
        for p in PROMPTS[:6]:
            ids = model.tokenizer.encode(p)
            out = gen(model, ids, head_dir, max_new_tokens=48)
            assert out.tokens == vanilla(model, ids, max_new_tokens=48).tokens
            new += out.stats["new_tokens"]
            forwards += out.stats["target_forwards"]
        return new / forwards

    trained, untrained = mean_accepted(tmp_path / "trained"), mean_accepted(random_dir)
    assert trained > untrained, (trained, untrained)


def test_heads_see_the_drafted_path(tiny):
    """A node's children come from its own path: the same depth under two parents gives two
    distributions (a proposer that ignored the path would give one)."""
    model = tiny(seed=0)
    head = random_hydra(model, std=0.2)
    f = torch.randn(1, model.model.cfg.hidden_size).expand(2, -1)
    emb = model.model.embed(torch.tensor([[5, 7], [5, 9]])).detach()
    out = head(1, f, emb)
    assert not torch.allclose(out[0], out[1])


# ============================================================================ sampling
@pytest.fixture(scope="module")
def no_eos(tiny):
    import dataclasses

    return dataclasses.replace(tiny(seed=0), eos_token_ids=set())


@pytest.fixture(scope="module")
def trained_hydra(no_eos, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained-hydra")
    train_tiny_head("hydra", no_eos, out / "head", steps=40, install_head=False)
    return load_head("hydra", no_eos, out / "head")[0]


class FlatQ(HydraProposer):
    """A planted error: the recorded draft distributions are not those the children were drawn from
    (uniform over the tokens the sampling filters keep)."""

    def propose(self, tokens, budget):
        tree = super().propose(tokens, budget)
        tree.q = {k: (q > 0).float() / (q > 0).sum() for k, q in tree.q.items()}
        return tree


@pytest.mark.parametrize("variant", ["exact", "flat_q"])
def test_sampling_distribution(no_eos, trained_hydra, chi2, variant):
    params = dict(temperature=1.0, top_k=4)
    ids = no_eos.tokenizer.encode("the cat sat on")
    cls = HydraProposer if variant == "exact" else FlatQ
    n = 1500
    counts, drafted, accepted = count_first_three(no_eos, ids, lambda: cls(no_eos, trained_hydra, tree_budget=12, top_k=2,
                                                                   beam=2), n, params)
    stat, df, pval = chi2_against(chi2, counts, joint3(no_eos, ids, SamplingParams(**params)))
    assert drafted > 0.9 * n and 0.05 * n < accepted, (drafted, accepted)
    if variant == "exact":
        assert pval > ALPHA, (stat, df, pval, drafted, accepted)
    else:
        assert pval < ALPHA, (stat, df, pval)  # caught


def test_vocabulary_subset_greedy(tiny, tmp_path):
    model = tiny(seed=0)
    head_dir = write_hydra(model, tmp_path / "h")
    for prompt in PROMPTS[:4]:
        ids = model.tokenizer.encode(prompt)
        out = gen(model, ids, head_dir, max_new_tokens=30, options={"draft_vocab": 64})
        assert out.tokens == vanilla(model, ids, max_new_tokens=30).tokens


# ============================================================================ train-head, errors
def test_train_head_cli_and_heads_list(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TRAIN_TEXT)
    out = tmp_path / "hydra"
    rc = cli_main(["train-head", "-m", "tiny-random:0", "--kind", "hydra", "--data", str(data), "--steps", "3",
                   "--seq-len", "32", "--text-chunks", "2", "--medusa-heads", "2", "--out", str(out),
                   "--no-progress", "--dtype", "fp32", "--train-vocab", "128", "--threads", "1"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["kind"] == "hydra" and printed["steps"] == 3
    assert cli_main(["heads", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [h["kind"] for h in listed] == ["hydra"] and listed[0]["config"]["heads"] == 2
    # installed: the method finds it in the store
    assert cli_main(["generate", "-m", "tiny-random:0", "--method", "hydra", "--max-new-tokens", "8",
                     "--dtype", "fp32", "hi "]) == 0


def test_typed_errors(tiny, tmp_path):
    model = tiny(seed=0)
    with pytest.raises(HeadNotFoundError, match="train-head"):
        leapdecode.generate(ModelRunner(model), "hello", method="hydra", max_new_tokens=4)
    d = write_hydra(tiny(seed=1), tmp_path / "other")
    with pytest.raises(HeadMismatchError, match="tiny-random:1"):
        leapdecode.generate(ModelRunner(model), "hi", method="hydra", options={"head": str(d)}, max_new_tokens=3)
    with pytest.raises(HeadMismatchError, match="not a medusa head"):
        leapdecode.generate(ModelRunner(tiny(seed=1)), "hi", method="medusa", options={"head": str(d)},
                            max_new_tokens=3)
    with pytest.raises(InvalidParameterError, match="HydraHeads"):
        HydraProposer(model, object())
