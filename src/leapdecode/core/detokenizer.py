"""Incremental detokenization and stop strings, linear in the output length.

``IncrementalDetokenizer`` decodes only a short window per step, the way vLLM and TGI do: it
keeps two offsets into the token list (``prefix``: where the window starts, ``read``: the end of
what was already turned into text), decodes ``tokens[prefix:]`` and ``tokens[prefix:read]``, and
the difference is the new text; a window that ends inside a multi-byte character (text ending
in U+FFFD) waits for the next token.  Decoding the whole output every step, as before, was
quadratic in its length.

``StopChecker`` looks for stop strings in the text added since the last check (plus the
longest stop string's length of the text before it), and says how much of the text can be
shown: never a piece that could still turn out to be the beginning of a stop string.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0
        # (tokens turned into text, characters of text) after each ``add``: maps a text cut to tokens
        self._marks: list[tuple[int, int]] = [(0, 0)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: list[int]) -> str:
        """Append tokens; returns the text they complete (possibly empty)."""
        if not ids:
            return ""
        self.tokens.extend(ids)
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        new = ""
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
            self.text += new
        self._marks.append((self._read, len(self.text)))
        return new

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character is shown as U+FFFD)."""
        if self._read == len(self.tokens):
            return ""
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        new = after[len(before) :]
        self._prefix = self._read = len(self.tokens)
        self.text += new
        self._marks.append((self._read, len(self.text)))
        return new

    def tokens_covering(self, n_chars: int) -> list[int]:
        """The shortest prefix of the tokens whose text reaches ``n_chars`` characters."""
        lo = 0
        for n_tok, n_text in self._marks:
            if n_text >= n_chars:
                # the prefix ends inside the last ``add``: decode prefixes of that step's tokens only
                want = self.text[:n_chars]
                for k in range(lo + 1, n_tok + 1):
                    # a prefix that ends inside a character decodes to U+FFFD: it does not cover it
                    if self._decode(self.tokens[:k])[:n_chars] == want:
                        return self.tokens[:k]
                return self.tokens[:n_tok]
            lo = n_tok
        return list(self.tokens)


class StopChecker:
    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self._longest = max((len(s) for s in stop), default=0)

    def find(self, text: str, since: int) -> int | None:
        """The earliest start of a stop string in ``text`` that ends after ``since``."""
        if not self.stop:
            return None
        start = max(0, since - self._longest + 1)
        cuts = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(cuts) if cuts else None

    def safe_length(self, text: str) -> int:
        """How much of ``text`` can be shown: not a possible beginning of a stop string at its end."""
        n = len(text)
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, n), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return n - held
