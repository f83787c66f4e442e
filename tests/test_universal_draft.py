"""UniversalDraftProposer: a draft with another tokenizer (universal assisted generation).

The target is the tiny byte-level model; drafts get a byte-level BPE trained here
in-process (so the two tokenizations really differ) or the byte tokenizer with one
extra token (same text segmentation, but the method registry sees another vocabulary).

Drafts are added to the target's runner by name (``runner.add_draft``) and named in
``options={"draft": NAME}``; every comparison is against explicit ``method="vanilla"``
(``generate``'s default method is ``auto``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode import ModelRunner, generate, runner_for
from leapdecode.core.prompt import encode_prompt
from leapdecode.errors import InvalidParameterError
from leapdecode.models.loader import LoadedModel
from leapdecode.models.tiny import byte_tokenizer, tiny_loaded, tiny_native
from leapdecode.proposers import build_proposer, method_config
from leapdecode.proposers.universal_draft import UniversalDraftProposer, chat_messages

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.
Speculative decoding drafts tokens with a small model and verifies them with a large one in a single pass.
The sky is blue because air scatters short wavelengths of sunlight more than long ones.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
Once upon a time there was a little house in the middle of a big forest, and in the house lived a cat.
"""
OTHER_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:{% endif %}"
)


def bpe_tokenizer(vocab_size: int = 360):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([CORPUS] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    tok.chat_template = OTHER_TEMPLATE
    return tok


def ascii_bias(model, tok):
    """Shrink the (tied) embeddings of all but printable ASCII tokens so greedy text is readable
    (random weights otherwise emit bytes that are not UTF-8, which cannot be re-tokenized)."""
    keep = set()
    for tid in range(model.vocab_size):
        s = tok.decode([tid])
        if s and all(c == " " or c == "\n" or 33 <= ord(c) < 127 for c in s):
            keep.add(tid)
    with torch.no_grad():
        for tid in range(model.vocab_size):
            if tid not in keep:
                model.embed.weight[tid] *= 0.05
    return model


def loaded(model, tok, name):
    eos = {tok.convert_tokens_to_ids("<|endoftext|>")}
    return LoadedModel(name=name, model=model, tokenizer=tok, eos_token_ids=eos)


def vanilla(model, prompt, **kw):
    return generate(model, prompt, method="vanilla", **kw)


def drafted(target, draft, prompt, **kw):
    """``generate`` with ``method="draft"`` and ``draft`` (a LoadedModel) added to the target's runner."""
    options = kw.pop("options", {})
    runner_for(target).add_draft(draft.name, draft)
    return generate(target, prompt, method="draft", options={"draft": draft.name, **options}, **kw)


def flagged_copy(tok):
    """The same tokenizer, with one unused token so its vocabulary differs."""
    t = copy.deepcopy(tok)
    t.add_tokens(["<|unused-flag|>"])
    return t


@pytest.fixture(scope="module")
def target():
    return tiny_loaded()


@pytest.fixture(scope="module")
def bpe_draft():
    tok = bpe_tokenizer()
    return loaded(tiny_native(seed=1, vocab_size=len(tok)), tok, "tiny-bpe")


@pytest.fixture(scope="module")
def bpe_target():
    tok = bpe_tokenizer()
    tok.chat_template = byte_tokenizer().chat_template
    return loaded(tiny_native(seed=2, vocab_size=len(tok)), tok, "tiny-bpe-target")


def test_routes_to_universal(target, bpe_draft):
    runner = ModelRunner(target)
    runner.add_draft("bpe", bpe_draft)
    p = build_proposer(method_config("draft", {"draft": "bpe", "tree_budget": 8}), runner)
    assert isinstance(p, UniversalDraftProposer) and p.default_budget == 8
    with pytest.raises(InvalidParameterError, match="bogus"):
        build_proposer(method_config("draft", {"draft": "bpe", "bogus": 1}), runner)
    # the same-tokenizer draft options are accepted (and ignored)
    assert isinstance(build_proposer(method_config("draft", {"draft": "bpe", "top_k": 2}), runner),
                      UniversalDraftProposer)
    # the other-tokenizer options reach it
    p = build_proposer(method_config("draft", {"draft": "bpe", "draft_len": 3, "min_draft_len": 1,
                                               "max_draft_len": 5}), runner)
    assert isinstance(p, UniversalDraftProposer) and (p.min_len, p.max_len) == (1, 5)


def test_the_vocabularies_are_compared_once_per_draft_and_runner(target, bpe_draft, monkeypatch):
    """``get_vocab`` builds a dict of the whole vocabulary (~0.2 s for 152k tokens): a runner compares
    a draft's with the target's once, not for every request; the answer is kept per pair."""
    from leapdecode.proposers.draft_model import DraftModelProposer

    calls = []
    for model in (target, bpe_draft):
        tok = model.tokenizer
        monkeypatch.setattr(tok, "get_vocab", lambda tok=tok, own=tok.get_vocab: calls.append(1) or own())
    runner = ModelRunner(target)
    runner.add_draft("bpe", bpe_draft)
    runner.add_draft("same", target)
    for _ in range(3):
        assert isinstance(build_proposer(method_config("draft", {"draft": "bpe"}), runner), UniversalDraftProposer)
        assert isinstance(build_proposer(method_config("draft", {"draft": "same"}), runner), DraftModelProposer)
    assert len(calls) == 4  # two comparisons, two vocabularies each
    other = ModelRunner(target)  # a runner keeps its own answers
    other.add_draft("bpe", bpe_draft)
    build_proposer(method_config("draft", {"draft": "bpe"}), other)
    assert len(calls) == 6


def test_tokenizers_differ(target, bpe_draft):
    text = "The quick brown fox"
    assert target.tokenizer.encode(text) != bpe_draft.tokenizer.encode(text)
    assert len(bpe_draft.tokenizer.encode(text)) < len(target.tokenizer.encode(text))


PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(alphabet="abcdefghij klmnop\n.,", min_size=1, max_size=60),
    st.sampled_from(["The quick brown", "def fibonacci(n):\n", "Once upon a", "héllo wörld — ✓ 日本"]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPTS, n=st.integers(1, 40), budget=st.integers(1, 20), chat=st.booleans())
def test_lossless_greedy_bpe_draft(target, bpe_draft, prompt, n, budget, chat):
    ref = vanilla(target, prompt, max_new_tokens=n, chat=chat)
    out = drafted(target, bpe_draft, prompt, max_new_tokens=n, chat=chat, options={"tree_budget": budget})
    assert out.tokens == ref.tokens
    assert out.text == ref.text
    assert out.finish_reason == ref.finish_reason


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPTS, n=st.integers(1, 40), budget=st.integers(1, 20), chat=st.booleans())
def test_lossless_greedy_bpe_target_byte_draft(bpe_target, target, prompt, n, budget, chat):
    """The other direction: the target merges bytes, so draft text can merge across the boundary."""
    ref = vanilla(bpe_target, prompt, max_new_tokens=n, chat=chat)
    out = drafted(bpe_target, target, prompt, max_new_tokens=n, chat=chat, options={"tree_budget": budget})
    assert out.tokens == ref.tokens


def test_sampling_runs(target, bpe_draft):
    out = drafted(target, bpe_draft, "Once upon a", max_new_tokens=30, temperature=0.8, seed=3)
    assert 1 <= len(out.tokens) <= 30
    assert out.stats["draft_forwards"] > 0


@pytest.fixture(scope="module")
def readable_pair():
    """Target and draft with the same (ASCII-biased) weights and tokenizers that differ only
    in one unused token: the draft predicts the target exactly."""
    tok = byte_tokenizer()
    model = ascii_bias(tiny_native(seed=0), tok)
    tgt = loaded(model, tok, "tiny-ascii")
    dft = loaded(model, flagged_copy(tok), "tiny-ascii-flagged")
    return tgt, dft


@pytest.mark.parametrize("chat", [False, True])
def test_agreeing_draft_is_accepted(readable_pair, chat):
    tgt, dft = readable_pair
    prompt = "The quick brown fox jumps over"
    ref = vanilla(tgt, prompt, max_new_tokens=80, chat=chat)
    assert ref.text.isascii() and len(ref.tokens) == 80
    # a runner of its own: the adaptive chain length starts from its default, nothing learned before
    runner = ModelRunner(tgt)
    runner.add_draft("flagged", dft)
    out = generate(runner, prompt, max_new_tokens=80, chat=chat, method="draft", options={"draft": "flagged"})
    assert out.tokens == ref.tokens
    assert out.stats["mean_accepted"] > 1.5, out.stats
    assert out.stats["mean_accepted"] > 4, out.stats  # the draft is the target: long chains pass
    assert out.stats["draft_len"] > 6  # adapted upwards


def test_agreeing_draft_with_merging_target(bpe_target):
    """Same weights, BPE target: re-encoding the draft's text must reproduce the target's
    merges (a word growing across the draft/decided boundary) for drafts to be accepted."""
    tok = bpe_target.tokenizer
    model = ascii_bias(tiny_native(seed=2, vocab_size=len(tok)), tok)
    tgt = loaded(model, tok, "tiny-bpe-ascii")
    dft = loaded(model, flagged_copy(tok), "tiny-bpe-ascii-flagged")
    prompt = "Once upon a time"
    ref = vanilla(tgt, prompt, max_new_tokens=60)
    out = drafted(tgt, dft, prompt, max_new_tokens=60)
    assert out.tokens == ref.tokens
    assert out.stats["mean_accepted"] > 1.5, out.stats


def test_chat_messages_roundtrip(target, bpe_draft):
    tok = target.tokenizer
    msgs = [{"role": "user", "content": "Hi there!\nHow are you?"}]
    ids = encode_prompt(target, msgs)
    assert chat_messages(tok, ids) == msgs
    msgs2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert chat_messages(tok, encode_prompt(target, msgs2)) == msgs2
    assert chat_messages(tok, tok.encode("plain text")) is None
    three = msgs2 + [{"role": "assistant", "content": "Because."}, {"role": "user", "content": "Ok"}]
    assert chat_messages(tok, encode_prompt(target, three)) is None


def test_chat_prompt_uses_draft_template(target, bpe_draft):
    runner = ModelRunner(target)
    runner.add_draft("bpe", bpe_draft)
    g = leapdecode.start_generation(runner, "Hello", chat=True, max_new_tokens=4, method="draft",
                                    options={"draft": "bpe"})
    g.run()
    p = g.proposer
    # the draft's own chat template renders the conversation for the draft
    head = bpe_draft.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                                   add_generation_prompt=True, tokenize=True)
    if isinstance(head, dict) or hasattr(head, "input_ids"):
        head = head["input_ids"]
    head = list(head)
    assert p.D[: len(head)] == head
    assert bpe_draft.tokenizer.decode(head) == "### user: Hello\n### assistant:"


@pytest.mark.integration
def test_smollm2_drafts_for_gemma3():
    # an integration test needs its models: a load error is a failure, not a skip
    tgt = leapdecode.load("gemma3-270m")
    dft = leapdecode.load("smollm2-135m", dtype=tgt.dtype, device=tgt.device)
    assert dft.tokenizer.get_vocab() != tgt.tokenizer.get_vocab()
    prompt = "Explain in a few sentences why the sky is blue."
    ref = vanilla(tgt, prompt, chat=True, max_new_tokens=48)
    out = drafted(tgt, dft, prompt, chat=True, max_new_tokens=48)
    print(f"\nvanilla: {ref.stats}\nuniversal draft: {out.stats}\ntext: {out.text!r}")
    assert out.tokens == ref.tokens
    assert out.stats["mean_accepted"] >= 1.0
