"""Offline chat prompts and English text for training a draft head (docs/heads.md).

The Python documentation's topic texts (``pydoc_data.topics``, part of every CPython install) are
cut into paragraphs; each paragraph is paired with one of a few instruction templates
(summarise, explain, translate, question and answer, rewrite, code example) and written as a
``{"chat": ...}`` JSONL line: prompts that `leapdecode train-head --data FILE.jsonl` asks through
the target's chat template and continues with the target's own greedy answers (self-distillation),
so the head sees chat-shaped, English, non-code answers as well as code.  ``--text`` also writes
the topics as plain text (``{"text": ...}`` lines) for teacher-forced features.

    python scripts/head_chat_prompts.py --out heads_data/chat.jsonl --text heads_data/docs.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

TEMPLATES = [
    "Summarize the following text in a few sentences.\n\n{p}",
    "Explain the following to a beginner, with a short example.\n\n{p}",
    "Translate the following text into German.\n\n{p}",
    "Translate the following text into French.\n\n{p}",
    "Translate the following text into Chinese.\n\n{p}",
    "Write three questions about the following text, each followed by its answer.\n\n{p}",
    "Rewrite the following text as a bulleted list of its key points.\n\n{p}",
    "Read the text below and answer: what is the single most important idea in it, and why?\n\n{p}",
    "Write a short Python program that demonstrates what the following text describes.\n\n{p}",
    "{p}\n\nBased on the text above, what mistakes do programmers commonly make here?",
]


def paragraphs(min_chars: int = 200, max_chars: int = 700) -> list[str]:
    import pydoc_data.topics as topics

    out = []
    for key in sorted(topics.topics):
        buf = ""
        for para in topics.topics[key].split("\n\n"):
            para = para.strip()
            if not para or set(para) <= set("*=-"):
                continue
            buf = f"{buf}\n\n{para}" if buf else para
            if len(buf) >= min_chars:
                out.append(buf[:max_chars])
                buf = ""
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSONL of chat prompts")
    ap.add_argument("--text", type=Path, help="also a JSONL of the topics as text (teacher-forced)")
    ap.add_argument("--n", type=int, default=200, help="chat prompts (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    paras = paragraphs()
    rng.shuffle(paras)
    lines = [json.dumps({"chat": TEMPLATES[i % len(TEMPLATES)].format(p=p)}) for i, p in enumerate(paras[: a.n])]
    _write(a.out, lines)
    if a.text:
        import pydoc_data.topics as topics

        _write(a.text, [json.dumps({"text": topics.topics[k]}) for k in sorted(topics.topics)])
    print(f"{len(lines)} chat prompts -> {a.out}" + (f"; topics text -> {a.text}" if a.text else ""))
    return 0


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
