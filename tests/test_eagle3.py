"""EAGLE-3 heads (issue 17): head kind ``eagle3``, decoded by ``method="eagle"``, on tiny random models.

1. The fused input: low, middle and high layer states of the verification forward (no patching),
   default layers ``2, N // 2, N - 3`` clamped; a head for layers the model lacks is refused.
2. Training-time test: the unrolled training outputs equal what decoding computes for a drafted
   chain (the same head through the proposer's attention pattern), and a planted mask error (a
   drafted row that sees the exact features of later positions) breaks that equality.
3. Greedy identity with vanilla (random and trained heads; the trained one accepts more); the
   chi-square test of sampled trees, and a planted error (a flat recorded ``q``) caught.
4. Old ``eagle`` heads stay loadable; ``head_kind`` picks among both; ``train-head --kind eagle3``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import leapdecode
from leapdecode import ModelRunner
from leapdecode.cli import main as cli_main
from leapdecode.core.sampling import SamplingParams
from leapdecode.errors import HeadMismatchError, InvalidParameterError
from leapdecode.training.accuracy import chain_hits
from leapdecode.training.train import eagle_loss
from leapdecode.proposers.heads.eagle import ttt_outputs
from leapdecode.models.kernel_library import kernel_problem
from leapdecode.proposers import METHODS
from leapdecode.proposers.heads.common import fingerprint
from leapdecode.proposers.heads.eagle import Eagle3Head, EagleHead, EagleProposer, default_layers
from leapdecode.proposers.heads.store import load_head, save_head
from helpers.heads import ALPHA, PROMPTS, TRAIN_TEXT, chi2_against, count_first_three, joint3, train_tiny_head, vanilla


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))


def random_head(cls, model, seed: int = 0, std: float = 0.05):
    torch.manual_seed(seed)
    head = cls.for_target(model)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    return head.eval()


def write(cls, model, directory, seed: int = 0):
    save_head(directory, random_head(cls, model, seed), {"target": {"name": model.name, "fingerprint":
                                                                    fingerprint(model)}, "steps": 0, "data": {}})
    return directory


def gen(model, ids, head_dir, **kw):
    return leapdecode.generate(ModelRunner(model), prompt_ids=ids, method="eagle",
                               options={"head": str(head_dir), **kw.pop("options", {})}, **kw)


# ============================================================================ 1. the fused input
def test_default_layers_and_fused_input(tiny):
    assert default_layers(28) == [2, 14, 25] and default_layers(2) == [0, 1, 2]
    model = tiny(seed=0)
    head = random_head(Eagle3Head, model)
    assert head.config["layers"] == [0, 1, 2] and head.kind == "eagle3"
    hidden: list = []
    ids = model.tokenizer.encode("the cat sat")
    cache = model.model.new_cache(1, 32)
    with torch.no_grad():
        model.model.forward(torch.tensor([ids]), cache, hidden_states=hidden)
        got = head.input_features(model.model, hidden, [1, 2])
        states = torch.cat([hidden[i][0, [1, 2]] for i in (0, 1, 2)], -1)
        assert torch.allclose(got, head.fuse_states(states))
        # each layer's state enters normalised: scaling one layer's stream changes nothing
        scaled = [h * (7.0 if i == 1 else 1.0) for i, h in enumerate(hidden)]
        assert torch.allclose(head.input_features(model.model, scaled, [1, 2]), got, atol=1e-5)
    with pytest.raises(InvalidParameterError, match="layers"):
        Eagle3Head.for_target(model, layers=[0, 5])


# ============================================================================ 2. training-time test
def _chain_by_decoding(head, inp, emb, row: int, steps: int) -> list[torch.Tensor]:
    """The head's outputs for the decided rows ``0 .. row`` and then a chain of ``steps - 1`` drafted
    tokens (the text's own), computed as EagleProposer does: a KV cache over the decided rows, each
    drafted row attending to them and to the drafted rows before it."""
    out, k, v = head(inp[: row + 1], emb[1 : row + 2], torch.arange(row + 1))
    outs = [out[row]]
    prev = out[row]
    for j in range(1, steps):
        o, nk, nv = head(prev[None], emb[row + 1 + j][None], torch.tensor([row + j]), k, v)
        k, v = torch.cat([k, nk], 1), torch.cat([v, nv], 1)
        outs.append(o[0])
        prev = o[0]
    return outs


def test_training_time_test_matches_decoding(tiny):
    model = tiny(seed=0)
    head = random_head(Eagle3Head, model, std=0.2)
    t, steps = 10, 3
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(t, 64, generator=g)
    emb = torch.randn(t + steps + 1, 64, generator=g)
    with torch.no_grad():
        outs = ttt_outputs(head, inp, emb, steps)
        for row in (0, 3, t - steps):
            want = _chain_by_decoding(head, inp, emb, row, steps)
            for j in range(steps):
                assert torch.allclose(outs[j][row], want[j], rtol=1e-4, atol=1e-4), (row, j)


def test_training_time_test_planted_mask_error_is_caught(tiny, monkeypatch):
    """A drafted row that sees the whole step-0 context (later positions' exact features included) is
    what a wrong TTT mask does; the equality with decoding catches it."""
    model = tiny(seed=0)
    head = random_head(Eagle3Head, model, std=0.2)
    t, steps = 10, 3
    g = torch.Generator().manual_seed(0)
    inp, emb = torch.randn(t, 64, generator=g), torch.randn(t + steps + 1, 64, generator=g)
    real_ones = torch.ones

    def leaky_ones(*shape, **kw):  # the causal block of every step: all True (a row sees later rows)
        m = real_ones(*shape, **kw)
        return m.triu() if kw.get("dtype") is torch.bool and len(shape) == 2 and shape[0] == shape[1] == t else m

    import leapdecode.training.train as ht

    monkeypatch.setattr(ht.torch, "ones", leaky_ones)
    with torch.no_grad():
        outs = ttt_outputs(head, inp, emb, steps)
    monkeypatch.undo()
    with torch.no_grad():
        want = _chain_by_decoding(head, inp, emb, 3, steps)
    assert not torch.allclose(outs[1][3], want[1], rtol=1e-3, atol=1e-3)


def test_chain_hits_scores_each_unrolled_step(tiny):
    """scripts/head_accuracy.py and head_gpu.py's top-1: labels that are the head's own first-step
    predictions score every row of step 0; one changed label, one hit fewer; ``skip`` leaves rows out."""
    model = tiny(seed=0)
    head = random_head(Eagle3Head, model, std=0.2)
    t, steps = 12, 3
    g = torch.Generator().manual_seed(2)
    inp, emb = torch.randn(t, 64, generator=g), torch.randn(t + steps + 1, 64, generator=g)
    weight = torch.randn(50, 64, generator=g)
    with torch.no_grad():
        first = (head.readout(ttt_outputs(head, inp, emb, steps)[0]) @ weight.T).argmax(-1)
        labels = torch.cat([torch.tensor([0]), first])
        res = chain_hits(head, inp, emb, labels, weight, steps)
        assert [c for _, c in res] == [t - j for j in range(steps)]
        assert res[0] == (t, t)
        labels[5] = (labels[5] + 1) % 50
        assert chain_hits(head, inp, emb, labels, weight, steps)[0] == (t - 1, t)
        assert chain_hits(head, inp, emb, labels, weight, steps, skip=5)[0] == (t - 5, t - 5)


@pytest.mark.parametrize("cls", [Eagle3Head, EagleHead])
def test_windows_side_by_side_equal_separate_windows(tiny, cls):
    """``segments``: several training windows in one call (scripts/head_gpu.py) give each window's
    own outputs, and with windows of equal length the mean of their separate losses; leaving the
    segments out (windows attend to each other, rows train on the next window's labels) does not."""
    model = tiny(seed=0)
    head = random_head(cls, model, std=0.2)
    n, w, steps = 3, 9, 3
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(n * w, 64, generator=g)
    toks = torch.randint(0, 200, (n * w,), generator=g)
    labels = torch.randint(0, 200, (n * w,), generator=g)
    weight = torch.randn(200, 64, generator=g)
    states = torch.randn(n * w, 64 * len(head.config.get("layers", [])), generator=g) if cls is Eagle3Head else None
    seg = torch.arange(n).repeat_interleave(w)
    embed = model.model.embed
    with torch.no_grad():
        emb = torch.cat([embed(toks).float(), torch.zeros(steps, 64)])
        outs = ttt_outputs(head, feats, emb, steps, seg)
        for i in range(n):
            sl = slice(i * w, (i + 1) * w)
            own = ttt_outputs(head, feats[sl], torch.cat([embed(toks[sl]).float(), torch.zeros(steps, 64)]), steps)
            for j in range(steps):
                # rows whose next token is in the window (the last ones read the next window's first token)
                    # (fp32 outputs of magnitude ~30: a matrix product blocked otherwise for another row
                    # count moves them by ~1e-5 on an AMX Xeon; a window reading another moves them by ~1)
                    a, b = outs[j][sl][: w - 1 - j], own[j][: w - 1 - j]
                    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (i, j, (a - b).abs().max().item())

        def loss(sl=slice(None), segments=None):
            return eagle_loss(head, feats[sl], toks[sl], labels[sl], weight, embed, noise=0.0, ttt_steps=steps,
                              states=None if states is None else states[sl], segments=segments)

        separate = torch.stack([loss(slice(i * w, (i + 1) * w)) for i in range(n)]).mean()
        side_by_side = loss(segments=seg)
        assert torch.allclose(side_by_side, separate, rtol=1e-4), (side_by_side, separate)
        assert not torch.allclose(loss(), separate, rtol=1e-3)


# ============================================================================ 3. identity and sampling
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_identity_random_eagle3_head(tiny, tmp_path, seed):
    model = tiny(seed=seed)
    d = write(Eagle3Head, model, tmp_path / "e3", seed=seed)
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokenizer.encode(prompt)
        for budget, penalty in ((None, 1.0), (1, 1.0), (5, 1.3), (32, 0.8)):
            n = 12 + 7 * i
            ref = vanilla(model, ids, max_new_tokens=n, repetition_penalty=penalty)
            out = gen(model, ids, d, max_new_tokens=n, repetition_penalty=penalty,
                      options={"tree_budget": budget} if budget else {})
            assert out.tokens == ref.tokens, (prompt, budget, penalty)
    long = model.tokenizer.encode("the cat sat on the mat " * 40)  # several prefill chunks
    assert gen(model, long, d, max_new_tokens=30).tokens == vanilla(model, long, max_new_tokens=30).tokens


def test_trained_eagle3_is_exact_and_accepts_more(tiny, tmp_path):
    model = tiny(seed=0)
    manifest = train_tiny_head("eagle3", model, tmp_path / "trained", steps=150, install_head=False)
    assert manifest["kind"] == "eagle3" and manifest["config"]["layers"] == [0, 1, 2]
    assert manifest["recipe"]["ttt_steps"] == 3
    random_dir = write(Eagle3Head, model, tmp_path / "random")

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


@pytest.fixture(scope="module")
def no_eos(tiny):
    return dataclasses.replace(tiny(seed=0), eos_token_ids=set())


@pytest.fixture(scope="module")
def trained_eagle3(no_eos, tmp_path_factory):
    # (150 steps, as the greedy test.  With 120 steps the exact test's fixed seeds 0..1499 gave p = 0.003,
    # while seeds 100000..103999 of the same head gave p = 0.72: a 1%-level test fails by chance on some
    # seed blocks, and these seeds are fixed)
    out = tmp_path_factory.mktemp("trained-eagle3")
    train_tiny_head("eagle3", no_eos, out / "head", steps=150, install_head=False)
    return load_head("eagle3", no_eos, out / "head")[0]


class FlatQ(EagleProposer):
    """A planted error: recorded draft distributions uniform over the kept tokens."""

    def propose(self, tokens, budget):
        tree = super().propose(tokens, budget)
        tree.q = {k: (q > 0).float() / (q > 0).sum() for k, q in tree.q.items()}
        return tree


@pytest.mark.parametrize("variant", ["exact", "exact_kernel_route", "flat_q"])
def test_sampling_distribution(no_eos, trained_eagle3, chi2, variant):
    # exact_kernel_route: int8 head weights, so the draft layer runs on the kernels' route (KernelDraftKV)
    if variant == "exact_kernel_route" and kernel_problem() is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {kernel_problem()}")
    params = dict(temperature=1.0, top_k=4)
    ids = no_eos.tokenizer.encode("the cat sat on")
    cls = FlatQ if variant == "flat_q" else EagleProposer
    weights = "int8" if variant == "exact_kernel_route" else "auto"
    made = []

    def make():
        made.append(cls(no_eos, trained_eagle3, tree_budget=12, top_k=2, beam=2, head_weights=weights))
        return made[-1]

    n = 1500
    counts, drafted, accepted = count_first_three(no_eos, ids, make, n, params)
    assert made[-1].stats()["eagle_layer_kernel"] == int(variant == "exact_kernel_route")
    stat, df, pval = chi2_against(chi2, counts, joint3(no_eos, ids, SamplingParams(**params)))
    assert drafted > 0.9 * n and accepted > 0.05 * n, (drafted, accepted)
    if variant != "flat_q":
        assert pval > ALPHA, (stat, df, pval, drafted, accepted)
    else:
        assert pval < ALPHA, (stat, df, pval)


# ============================================================================ 4. kinds, CLI
def test_old_eagle_heads_load_and_head_kind_picks(tiny, tmp_path):
    model = tiny(seed=0)
    write(EagleHead, model, tmp_path / "both" / "a-eagle")
    write(Eagle3Head, model, tmp_path / "both" / "b-eagle3")
    assert type(load_head("eagle", model, tmp_path / "both" / "a-eagle")[0]) is EagleHead
    ids = model.tokenizer.encode("hello hello")
    want = vanilla(model, ids, max_new_tokens=12).tokens
    for head_kind, cls in (("auto", Eagle3Head), ("eagle3", Eagle3Head), ("eagle", EagleHead)):
        g = leapdecode.start_generation(ModelRunner(model), prompt_ids=ids, method="eagle", max_new_tokens=12,
                                        options={"head": str(tmp_path / "both"), "head_kind": head_kind})
        assert type(g.proposer.head) is cls, head_kind
        assert g.run().tokens == want
    # an old eagle head directory still decodes under the default head_kind
    assert gen(model, ids, tmp_path / "both" / "a-eagle", max_new_tokens=12).tokens == want
    with pytest.raises(HeadMismatchError, match="not a eagle3 head"):
        gen(model, ids, tmp_path / "both" / "a-eagle", max_new_tokens=4, options={"head_kind": "eagle3"})
    with pytest.raises(InvalidParameterError):
        METHODS["eagle"].config.from_options({"head_kind": "eagle4"})


def test_train_head_cli_eagle3(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TRAIN_TEXT)
    out = tmp_path / "e3"
    rc = cli_main(["train-head", "-m", "tiny-random:0", "--kind", "eagle3", "--data", str(data), "--steps", "2",
                   "--seq-len", "32", "--text-chunks", "2", "--out", str(out), "--no-progress", "--dtype", "fp32",
                   "--eagle-intermediate", "32", "--train-vocab", "128", "--threads", "1", "--eagle-layers", "1",
                   "2", "--ttt-steps", "2"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["kind"] == "eagle3" and printed["steps"] == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["layers"] == [1, 2] and manifest["recipe"]["ttt_steps"] == 2
    assert cli_main(["heads", "list"]) == 0 and "eagle3" in capsys.readouterr().out
    assert cli_main(["generate", "-m", "tiny-random:0", "--method", "eagle", "--max-new-tokens", "8", "--dtype",
                     "fp32", "hi "]) == 0
    assert cli_main(["train-head", "-m", "tiny-random:0", "--kind", "eagle3", "--eagle-layers", "9", "--out",
                     str(tmp_path / "bad"), "--data", str(data), "--no-progress", "--dtype", "fp32"]) == 2


@pytest.mark.parametrize("kind", ["hydra", "eagle3"])
def test_prompt_features_prefix_cache_and_batch(tiny, tmp_path, kind):
    """Hydra and EAGLE-3 heads read the prefill's features (the first step drafts), stay exact when the
    prefix cache restores a prompt chunk (no features for it) and in batched steps (core/batch)."""
    from leapdecode.core.batch import step_batch
    from helpers.heads import write_hydra

    model = tiny(seed=0)
    head_dir = write_hydra(model, tmp_path / kind) if kind == "hydra" else write(Eagle3Head, model, tmp_path / kind)
    method = "hydra" if kind == "hydra" else "eagle"
    opts = {"head": str(head_dir)}
    runner = ModelRunner(model)
    ids = model.tokenizer.encode("the cat sat on the mat the cat")
    g = leapdecode.start_generation(runner, prompt_ids=ids, method=method, options=opts, max_new_tokens=20)
    sizes = []
    propose = g.proposer.propose
    g.proposer.propose = lambda tokens, budget: sizes.append(len(t := propose(tokens, budget))) or t
    assert g.run().tokens == vanilla(model, ids, max_new_tokens=20).tokens
    assert sizes[0] > 0, sizes
    long = model.tokenizer.encode("def f(x):\n    return x\n" * 30)  # more than one 256-token chunk
    want = vanilla(model, long, max_new_tokens=24).tokens
    for _ in range(2):  # the second run restores the first chunk from the runner's prefix cache
        out = leapdecode.generate(runner, prompt_ids=long, method=method, options=opts, max_new_tokens=24)
        assert out.tokens == want
    assert out.stats["prefix_reused"] >= 256
    prompts = [model.tokenizer.encode(p) for p in PROMPTS[:4]] + [long]
    gens = [leapdecode.start_generation(runner, prompt_ids=p, method=method, options=opts, max_new_tokens=16)
            for p in prompts]
    while not all(x.finished for x in gens):
        for o in step_batch([x for x in gens if not x.finished]):
            assert o.error is None, o.error
    for p, x in zip(prompts, gens):
        assert x.result.tokens == vanilla(model, p, max_new_tokens=16).tokens
