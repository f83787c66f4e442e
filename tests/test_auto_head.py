"""``auto`` with a trained head (issue 17): when the model cache holds a head for the loaded target,
auto's bandit gets a ``head`` arm (the head's tree; with ``head_graft`` the suffix automaton's continuation too);
without one, auto's arms are what they were.

Tests on a tiny random target with a head trained for a few seconds into a temporary store: the
arms with and without a head (and with ``use_head=False``), greedy identity with vanilla while the
head arm is used, the chi-square test of sampled output through auto's head arm, a planted error in
the head's recorded ``q`` that the same test catches, and a damaged store entry that auto skips.
"""

from __future__ import annotations

import dataclasses

import pytest

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.sampling import SamplingParams
from leapdecode.proposers import build_proposer, method_config
from leapdecode.proposers.auto import AutoProposer
from leapdecode.proposers.heads.eagle import EagleProposer
from leapdecode.proposers.heads.store import MANIFEST, load_head, store_dir
from helpers.heads import ALPHA, PROMPTS, chi2_against, count_first_three, joint3, train_tiny_head, vanilla


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def no_eos(tiny):
    return dataclasses.replace(tiny(seed=0), eos_token_ids=set())


@pytest.fixture(scope="module")
def eagle_run(no_eos, tmp_path_factory):
    """An eagle head trained for a few seconds (its --out directory; installed per test)."""
    out = tmp_path_factory.mktemp("auto-eagle") / "head"
    train_tiny_head("eagle", no_eos, out, steps=150, install_head=False)
    return out


def install(run_dir, model):
    from leapdecode.proposers.heads.store import install as install_head

    return install_head(run_dir, model)


def start(model, ids, **kw):
    return leapdecode.start_generation(ModelRunner(model), prompt_ids=ids, method="auto", **kw)


def test_without_a_head_the_arms_are_unchanged(tiny):
    model = tiny(seed=0)
    ids = model.tokenizer.encode("the cat sat on the mat the cat")
    g = start(model, ids, max_new_tokens=20)
    assert g.proposer.arms == ["sam", "none"] and g.proposer.head is None
    assert not g.proposer.wants_hidden() and g.proposer.prompt_features() == 0
    res = g.run()
    assert res.tokens == vanilla(model, ids, max_new_tokens=20).tokens
    assert set(res.stats["auto_arms"]) <= {"sam", "none"}


def test_the_none_arm_only_where_chains_are_not_sized_by_cost(tiny, fresh_runner):
    """Greedy with a cost profile: the automaton drafts nothing where nothing is worth its rows, so
    auto never spends a step on ``none``; sampling (no clock may steer it) keeps the arm."""
    from leapdecode.core.cost_model import VerifyCost

    model = tiny(seed=0)
    ids = model.tokenizer.encode("the cat sat on the mat the cat")
    steep = VerifyCost([1, 2, 8], [1.0, 1.9, 8.0])  # a draft row costs nearly a forward: sam rarely drafts
    runner = fresh_runner(model, verify_cost=steep)
    res = leapdecode.generate(runner, prompt_ids=ids, method="auto", max_new_tokens=40)
    assert res.tokens == vanilla(model, ids, max_new_tokens=40).tokens
    assert set(res.stats["auto_arms"]) == {"sam"}
    used = set()
    for seed in range(6):
        out = leapdecode.generate(fresh_runner(model), prompt_ids=ids, method="auto", max_new_tokens=40,
                                  temperature=1.0, seed=seed)
        used |= set(out.stats["auto_arms"])
    assert "none" in used


def test_auto_uses_the_stored_head_greedy_exact(tiny, eagle_run):
    model = tiny(seed=0)  # the same weights as no_eos: the head's fingerprint matches
    install(eagle_run, model)
    used = 0
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokenizer.encode(prompt)
        g = start(model, ids, max_new_tokens=24 + 5 * i)
        assert g.proposer.arms == ["sam", "head", "none"]
        assert isinstance(g.proposer.head, EagleProposer) and g.proposer.wants_hidden()
        res = g.run()
        assert res.tokens == vanilla(model, ids, max_new_tokens=24 + 5 * i).tokens, prompt
        used += res.stats["auto_arms"].get("head", 0)
        assert "eagle_steps" in res.stats
    assert used > 0
    # use_head=False: the old arms
    g = start(model, model.tokenizer.encode("hello"), max_new_tokens=8, options={"use_head": False})
    assert g.proposer.arms == ["sam", "none"]
    # another target (other weights) finds no head
    other = tiny(seed=1)
    assert start(other, other.tokenizer.encode("hello"), max_new_tokens=8).proposer.head is None


@pytest.mark.parametrize("graft", [True, False])
def test_the_automatons_graft_on_the_heads_tree_is_an_option(tiny, eagle_run, monkeypatch, graft):
    """By default the head arm verifies the head's tree alone (no node from the automaton);
    ``head_graft=True`` adds the automaton's continuation on repetitive text.  Greedy exact both ways."""
    model = tiny(seed=0)
    install(eagle_run, model)
    sources: list[set] = []
    original = AutoProposer.propose

    def spy(self, tokens, budget):
        tree = original(self, tokens, budget)
        if self._arm == "head":
            sources.append(set(tree.sources))
        return tree

    monkeypatch.setattr(AutoProposer, "propose", spy)
    ids = model.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat sat on the mat.")
    options = {"head_graft": True} if graft else {}
    g = start(model, ids, max_new_tokens=40, options=options)
    assert g.proposer.head_graft is graft
    res = g.run()
    assert res.tokens == vanilla(model, ids, max_new_tokens=40).tokens
    assert sources, "the head arm never drafted"
    assert any("sam" in s for s in sources) is graft


def test_head_arm_next_to_a_draft_model_arm(tiny, eagle_run):
    """With a same-tokenizer draft model and a stored head the bandit has both arms; exact."""
    model = tiny(seed=0)
    install(eagle_run, model)
    runner = ModelRunner(model)
    runner.add_draft("noisy-copy", tiny(seed=0, noise=0.02))
    uses: dict = {}
    for prompt in PROMPTS[:5]:
        ids = model.tokenizer.encode(prompt)
        g = leapdecode.start_generation(runner, prompt_ids=ids, method="auto", options={"draft": "noisy-copy"},
                                        max_new_tokens=30)
        assert g.proposer.arms == ["sam", "hybrid", "head", "none"]
        res = g.run()
        assert res.tokens == vanilla(model, ids, max_new_tokens=30).tokens, prompt
        for arm, n in res.stats["auto_arms"].items():
            uses[arm] = uses.get(arm, 0) + n
    assert uses.get("head", 0) > 0 and uses.get("hybrid", 0) > 0, uses


def test_the_registered_draft_arm_gives_way_to_a_trained_head(tiny, eagle_run):
    """The registered draft pair gives auto a draft-model arm only while the target has no trained
    head; with one (and no named draft) the arms are the automaton, the head and none; exact."""
    model = dataclasses.replace(tiny(seed=0), draft_name="pair")
    runner = ModelRunner(model)
    runner.add_draft("pair", tiny(seed=0, noise=0.02))
    ids = model.tokenizer.encode(PROMPTS[0])
    assert leapdecode.start_generation(runner, prompt_ids=ids, method="auto").proposer.arms == ["sam", "hybrid", "none"]
    install(eagle_run, model)
    runner = ModelRunner(model)  # (a runner looks the store up once)
    runner.add_draft("pair", tiny(seed=0, noise=0.02))
    g = leapdecode.start_generation(runner, prompt_ids=ids, method="auto", max_new_tokens=20)
    assert g.proposer.arms == ["sam", "head", "none"] and g.proposer.draft is None
    assert g.run().tokens == vanilla(model, ids, max_new_tokens=20).tokens
    named = leapdecode.start_generation(runner, prompt_ids=ids, method="auto", options={"draft": "pair"})
    assert named.proposer.arms == ["sam", "hybrid", "head", "none"]


def test_a_damaged_store_entry_is_skipped(tiny, eagle_run):
    model = tiny(seed=0)
    d = install(eagle_run, model)
    (d / MANIFEST).write_text("{broken")
    ids = model.tokenizer.encode("hello hello hello")
    g = start(model, ids, max_new_tokens=12)
    assert g.proposer.head is None
    assert g.run().tokens == vanilla(model, ids, max_new_tokens=12).tokens
    assert store_dir("eagle", model).is_dir()


class FlatQ(EagleProposer):
    """A planted error: the head's recorded draft distributions are uniform over the kept tokens."""

    def propose(self, tokens, budget):
        tree = super().propose(tokens, budget)
        tree.q = {k: (q > 0).float() / (q > 0).sum() for k, q in tree.q.items()}
        return tree


@pytest.mark.parametrize("variant", ["exact", "flat_q"])
def test_sampling_through_the_head_arm(no_eos, eagle_run, chi2, variant):
    params = dict(temperature=1.0, top_k=4)
    ids = no_eos.tokenizer.encode("the cat sat on")
    made: list = []
    if variant == "exact":
        install(eagle_run, no_eos)
        builder = ModelRunner(no_eos)  # loads the stored head once
        cfg = method_config("auto", {"tree_budget": 12})

        def make():
            made.append(build_proposer(cfg, builder))
            return made[-1]
    else:
        head = load_head("eagle", no_eos, eagle_run)[0]

        def make():
            made.append(AutoProposer(None, tree_budget=12,
                                     head_proposer=FlatQ(no_eos, head, tree_budget=12, top_k=2, beam=2)))
            return made[-1]

    n = 1500
    counts, drafted, accepted = count_first_three(no_eos, ids, make, n, params)
    assert sum(p.stats()["auto_arms"].get("head", 0) for p in made) > n  # the head arm drafted
    assert drafted > 0.9 * n and accepted > 0.05 * n, (drafted, accepted)
    stat, df, pval = chi2_against(chi2, counts, joint3(no_eos, ids, SamplingParams(**params)))
    if variant == "exact":
        assert pval > ALPHA, (stat, df, pval, drafted, accepted)
    else:
        assert pval < ALPHA, (stat, df, pval)


def test_an_arm_is_timed_from_its_propose_to_its_observe(tiny, monkeypatch):
    """The bandit's reward is tokens over the step's own time: time spent after ``observe`` (a batched
    engine's plain steps, grammar-forced tokens, a slow consumer) is not charged to the arm that drafted.
    auto's clock is a fake one (1 ms per reading, 1000 s per pause), so no real timing is involved."""
    import types

    from leapdecode.proposers import auto as auto_module

    clock = {"t": 0.0}

    def perf_counter():
        clock["t"] += 1e-3
        return clock["t"]

    monkeypatch.setattr(auto_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    model = tiny(seed=0)
    ids = model.tokenizer.encode("the cat sat on the mat the cat")
    g = start(model, ids, max_new_tokens=4)
    auto = g.proposer
    observe = auto.observe
    pause = 1000.0

    def slow_after_observe(*a, **k):
        observe(*a, **k)
        clock["t"] += pause

    auto.observe = slow_after_observe
    g.run()
    means = [m for m, _ in auto.bandit.snapshot().values()]
    assert means
    # charged with the pause, no step could reach 1 + tree budget tokens per pause
    assert min(means) > (1 + auto.default_budget) / pause, auto.bandit.snapshot()


def test_the_heads_catching_up_is_charged_to_no_arm(tiny, eagle_run, monkeypatch):
    """The head feeds the prompt, and the positions of steps other arms drafted, at its next draft:
    a cost paid once whichever arm runs, so ``catchup_seconds`` is left out of the head arm's reward.
    Planted: every head draft reports a catch-up of 1000 s (and the fake clock moves by as much); the
    head's rewards stay those of its own time.  auto's clock is a fake one (1 ms per reading)."""
    import types

    from leapdecode.proposers import auto as auto_module

    model = tiny(seed=0)
    install(eagle_run, model)
    clock = {"t": 0.0}

    def perf_counter():
        clock["t"] += 1e-3
        return clock["t"]

    monkeypatch.setattr(auto_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    pause = 1000.0
    original = EagleProposer.propose

    def slow_catchup(self, tokens, budget):
        clock["t"] += pause  # the catch-up, measured by the head
        return original(self, tokens, budget)

    monkeypatch.setattr(EagleProposer, "propose", slow_catchup)
    monkeypatch.setattr(EagleProposer, "catchup_seconds", lambda self: pause)
    g = start(model, model.tokenizer.encode("the cat sat on the mat the cat"), max_new_tokens=24)
    res = g.run()
    assert res.stats["auto_arms"].get("head", 0) > 0
    head_means = [m for k, (m, _) in g.proposer.bandit.snapshot().items() if k.startswith("head@")]
    assert head_means and min(head_means) > 1 / 0.1, g.proposer.bandit.snapshot()  # ms-scale steps, not 1000 s


def test_catchup_is_the_prompt_and_other_arms_steps(tiny, eagle_run, monkeypatch):
    """EAGLE's ``catchup_seconds``: positive on its first draft (the prompt's positions) and on a draft
    after steps another arm made; zero when it drafted the step before (it feeds only that step's
    tokens)."""
    model = tiny(seed=0)
    install(eagle_run, model)
    seen: list[tuple[bool, float]] = []  # (the head drafted the step before, its catch-up)
    last = {"head": False}
    original = AutoProposer.propose

    def spy(self, tokens, budget):
        tree = original(self, tokens, budget)
        if self._arm == "head" and self.head.n_fed == len(tokens):  # the head fed up to this root
            seen.append((last["head"], self.head.catchup_seconds()))
        last["head"] = self._arm == "head"
        return tree

    monkeypatch.setattr(AutoProposer, "propose", spy)
    ids = model.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the dog")
    g = start(model, ids, max_new_tokens=60, options={"explore": 2.0})  # both arms, often
    g.run()
    after_head = [c for prev, c in seen if prev]
    after_other = [c for prev, c in seen[1:] if not prev]
    assert seen and seen[0][1] > 0  # the prompt
    assert after_head and all(c == 0 for c in after_head)
    assert after_other and all(c > 0 for c in after_other)
