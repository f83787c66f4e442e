"""Incremental detokenization and stop strings (``core/detokenizer.py``).

1. ``IncrementalDetokenizer``: the pieces ``add`` returns (and ``flush`` at the end), joined, are
   ``tokenizer.decode(all tokens, skip_special_tokens=True)``, however the tokens are split into
   steps -- random token sequences (hypothesis) on the tiny byte tokenizer (bytes that are not
   UTF-8, multi-byte characters split across tokens, special tokens) and, marked ``integration``,
   on smollm2-135m's BPE tokenizer; a piece never ends inside a character (no U+FFFD until the end).
2. ``tokens_covering(n)``: the shortest prefix of the tokens whose text begins with the first ``n``
   characters of the text, whatever the steps were.
3. ``StopChecker.find``: a stop string spanning steps is found at the step that completes it, at
   the earliest start; ``safe_length`` withholds exactly the end of the text that could still
   become a stop string, and nothing else.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from leapdecode.core.detokenizer import IncrementalDetokenizer, StopChecker
from leapdecode.models.tiny import byte_tokenizer

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.lru_cache(maxsize=1)
def tok():
    return byte_tokenizer()


@functools.lru_cache(maxsize=1)
def byte_to_symbol() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the symbol standing for each byte (the byte tokenizer's tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_ids(data: bytes) -> list[int]:
    """The byte tokenizer's token ids of raw bytes (valid UTF-8 or not): one token per byte."""
    t, table = tok(), byte_to_symbol()
    ids = [t.convert_tokens_to_ids(table[b]) for b in data]
    assert all(0 <= i < 256 for i in ids)
    return ids


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """``ids`` in steps, cut at the (sorted, deduplicated) positions ``cuts``."""
    bounds = [0] + sorted({c for c in cuts if 0 < c < len(ids)}) + [len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def run_steps(tokenizer, steps: list[list[int]]) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(s) for s in steps]
    pieces.append(detok.flush())
    return detok, pieces


# raw bytes: UTF-8 text with multi-byte characters, or arbitrary bytes (not UTF-8)
TEXTS = st.text(alphabet=st.sampled_from(list("ab \n") + ["é", "ß", "日", "本", "😀", "\u0301"]), max_size=20)
RAW = st.one_of(TEXTS.map(lambda s: s.encode()), st.binary(max_size=24))


@st.composite
def byte_token_steps(draw):
    data = draw(RAW)
    ids = byte_ids(data)
    # sprinkle special tokens (ids 256..258: skipped by decode)
    for _ in range(draw(st.integers(0, 3))):
        ids.insert(draw(st.integers(0, len(ids))), draw(st.integers(256, 258)))
    cuts = draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=len(ids)))
    return ids, split(ids, cuts)


# ============================================================================ 1. the pieces
@FAST
@given(byte_token_steps())
def test_pieces_join_to_the_decoded_text(case):
    ids, steps = case
    t = tok()
    detok, pieces = run_steps(t, steps)
    want = decode(t, ids)
    assert "".join(pieces) == want == detok.text
    assert detok.tokens == ids
    # before the end a piece never holds a character cut in half (the end may: flush shows U+FFFD)
    for piece, step in zip(pieces[:-1], steps):
        if piece:
            assert not piece.endswith("\ufffd") or "\ufffd" in want, (piece, step)


@FAST
@given(st.lists(st.integers(0, 258), max_size=30), st.lists(st.integers(0, 30), max_size=30))
def test_random_token_ids_in_random_steps(ids, cuts):
    t = tok()
    detok, pieces = run_steps(t, split(ids, cuts))
    assert "".join(pieces) == decode(t, ids) == detok.text


def test_multibyte_characters_split_across_tokens():
    t = tok()
    text = "a日本é😀b"
    ids = byte_ids(text.encode())
    assert len(ids) == len(text.encode()) > len(text)  # one token per byte
    detok = IncrementalDetokenizer(t)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == text and detok.flush() == ""
    # a character's piece comes with its last byte, and no piece is a broken character
    assert [p for p in pieces if p] == list(text)
    assert pieces[:4] == ["a", "", "", "日"]
    # an unfinished character at the end is shown by flush (as the tokenizer decodes it)
    detok = IncrementalDetokenizer(t)
    cut = byte_ids("x日".encode())[:-1]
    assert detok.add(cut[:1]) == "x"
    assert detok.add(cut[1:]) == ""
    assert detok.flush() == decode(t, cut)[1:] and detok.text == decode(t, cut)


def test_special_tokens_are_skipped():
    t = tok()
    end = t.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(t)
    assert detok.add(byte_ids(b"hi") + [end]) == "hi"
    assert detok.add([end]) == ""
    assert detok.add(byte_ids(b"!")) == "!"
    assert detok.tokens == byte_ids(b"hi") + [end, end] + byte_ids(b"!")


@pytest.fixture(scope="module")
def smol_tokenizer():
    import leapdecode

    # an integration test needs its model: a load error is a failure, not a skip
    return leapdecode.load("smollm2-135m", dtype="fp32", device="cpu").tokenizer


@pytest.mark.integration
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pieces_join_to_the_decoded_text_smollm2(smol_tokenizer, data):
    t = smol_tokenizer
    if data.draw(st.booleans()):  # real text (multi-byte characters split across BPE tokens)
        ids = t.encode(data.draw(TEXTS) + data.draw(st.text(max_size=12)), add_special_tokens=False)
    else:  # any token ids, specials included
        ids = data.draw(st.lists(st.integers(0, len(t) - 1), max_size=30))
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=len(ids)))
    detok, pieces = run_steps(t, split(ids, cuts))
    assert "".join(pieces) == decode(t, ids) == detok.text


@pytest.mark.integration
def test_emoji_across_bpe_tokens_smollm2(smol_tokenizer):
    t = smol_tokenizer
    text = "fine 😀 日本語 naïve"
    ids = t.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(t)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == decode(t, ids) == text
    assert not any("\ufffd" in p for p in pieces)


# ============================================================================ 2. tokens_covering
def shortest_covering(tokenizer, ids: list[int], text: str, n: int) -> list[int]:
    """Brute force: the shortest prefix of ``ids`` whose decoded text begins with ``text[:n]``."""
    for k in range(len(ids) + 1):
        if decode(tokenizer, ids[:k])[:n] == text[:n]:
            return ids[:k]
    raise AssertionError("the whole sequence must cover its own text")


@FAST
@given(byte_token_steps())
def test_tokens_covering_is_the_shortest_prefix_that_spells_the_text(case):
    ids, steps = case
    t = tok()
    detok, _ = run_steps(t, steps)
    for n in range(len(detok.text) + 1):
        got = detok.tokens_covering(n)
        assert got == shortest_covering(t, ids, detok.text, n), (n, detok.text)
        assert decode(t, got)[:n] == detok.text[:n]


@FAST
@given(byte_token_steps())
def test_tokens_covering_does_not_depend_on_the_steps(case):
    """One token per step (vanilla) and several per step (speculation) cut at the same token."""
    ids, steps = case
    t = tok()
    one, _ = run_steps(t, [[i] for i in ids])
    many, _ = run_steps(t, steps)
    assert one.text == many.text
    for n in range(len(one.text) + 1):
        assert one.tokens_covering(n) == many.tokens_covering(n), (n, one.text)


def test_tokens_covering_a_character_needs_all_its_bytes():
    t = tok()
    ids = byte_ids("aߦb".encode())  # "ߦ" is two bytes
    detok = IncrementalDetokenizer(t)
    detok.add(ids)  # one step (as after a speculative step)
    assert detok.tokens_covering(0) == []
    assert detok.tokens_covering(1) == ids[:1]
    assert detok.tokens_covering(2) == ids[:3]  # both bytes of "ߦ", not the first one alone (U+FFFD)
    assert detok.tokens_covering(3) == ids


# ============================================================================ 3. stop strings
STOP_ALPHABET = "abc"


@FAST
@given(st.text(alphabet=STOP_ALPHABET, max_size=30), st.lists(st.integers(0, 30), max_size=10),
       st.lists(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_are_found_across_steps(text, cuts, stops):
    checker = StopChecker(stops)
    bounds = [0] + sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    found = None
    for since, end in zip(bounds, bounds[1:]):
        sofar = text[:end]
        hits = [sofar.find(s) for s in stops if s in sofar]
        got = checker.find(sofar, since)
        if hits:  # the step that completes the first stop string: its earliest start
            assert got == min(hits), (sofar, since, stops)
            found = got
            break
        assert got is None, (sofar, since, stops)
    if found is None:
        assert not any(s in text for s in stops)


def test_a_stop_string_spanning_three_steps():
    checker = StopChecker(["<END>", "xyz"])
    assert checker.find("hello <E", 0) is None
    assert checker.find("hello <EN", len("hello <E")) is None
    assert checker.find("hello <END> more", len("hello <EN")) == len("hello ")
    assert StopChecker([]).find("anything", 0) is None


def possible_stop_starts(text: str, stops: list[str]) -> list[int]:
    """Positions where a stop string could still begin: ``text[i:]`` is a proper prefix of a stop."""
    return [i for i in range(len(text)) for s in stops if len(text) - i < len(s) and s.startswith(text[i:])]


@FAST
@given(st.text(alphabet=STOP_ALPHABET + "d", max_size=12),
       st.lists(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
def test_safe_length_withholds_exactly_the_possible_beginnings_of_stop_strings(text, stops):
    assume(not any(s in text for s in stops))  # (a text with a stop string in it is cut, not withheld)
    n = StopChecker(stops).safe_length(text)
    starts = possible_stop_starts(text, stops)
    # what is shown can never turn out to be part of a stop string; everything else is shown
    assert n == min(starts, default=len(text)), (text, stops, n)


def test_safe_length_examples():
    checker = StopChecker(["###", "\n\nUser:"])
    assert checker.safe_length("answer") == len("answer")
    assert checker.safe_length("answer#") == len("answer")
    assert checker.safe_length("answer##") == len("answer")
    assert checker.safe_length("answer\n\nUs") == len("answer")
    assert checker.safe_length("answer\n") == len("answer")
    assert checker.safe_length("a#b") == 3
    assert StopChecker([]).safe_length("abc") == 3
    # two stop strings: only a possible beginning of one of them is withheld
    assert StopChecker(["bx", "ay"]).safe_length("ab") == 1
