"""``leapdecode datastore``: build and inspect REST datastores (``method="rest"``).

``leapdecode datastore build FILES... --model NAME --out PATH`` tokenizes text
(``.txt``/``.md``), ``.jsonl`` (the ``turns``/``messages``/``text``/``content``
of each line, else its string fields) and source files (``.py`` and other
code; directories are walked) with the model's tokenizer and writes one
datastore file.  Presets need no files:

* ``--preset stdlib``: the Python standard library's ``*.py`` files (library
  modules first, then its test suites; 20 MB of text by default), written to
  the model's default datastore, which ``method="rest"`` uses when no
  ``datastore`` is given;
* ``--preset self-answers``: the model's own greedy answers to the prompts of a
  Spec-Bench-format workload (default: the dev questions), for chat; REST's
  datastores are conversation corpora, and a model's own answers are what its
  future answers look like.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path
from typing import Iterator

from .errors import InvalidParameterError
from .models.store import check_output

PRESETS = ["stdlib", "self-answers"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from .cli_args import add_model_args

    p = subparsers.add_parser("datastore", help="build or inspect a REST datastore (--method rest)",
                              description="Retrieval datastores for --method rest (REST, He et al., 2024).")
    sub = p.add_subparsers(dest="datastore_action", metavar="ACTION")
    b = sub.add_parser("build", help="tokenize files (or a preset corpus) into a datastore",
                       description="Tokenize text/jsonl/source files (directories are walked) with the model's "
                                   "tokenizer and index them with a suffix array.")
    add_model_args(b)
    b.add_argument("files", nargs="*", help=".txt/.md, .jsonl, source files (.py, ...) or directories")
    b.add_argument("--preset", choices=PRESETS,
                   help="stdlib: the Python standard library's sources (code); self-answers: the model's own "
                        "answers to --workload prompts (chat)")
    b.add_argument("-o", "--out", type=Path,
                   help="output file (default with --preset: the model's default datastore in the cache, "
                        "<cache>/datastores/<model>-<preset>.npz)")
    b.add_argument("--max-tokens", type=int, help="stop after this many tokens")
    b.add_argument("--max-mb", type=float,
                   help="stop after this many MB of text (default: 20 with --preset stdlib, else no limit)")
    b.add_argument("--workload", help="self-answers: Spec-Bench-format jsonl (default: the dev questions)")
    b.add_argument("--limit", type=int, help="self-answers: number of questions (default: all)")
    b.add_argument("--answer-tokens", type=int, default=256, help="self-answers: max new tokens per answer")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--json", action="store_true", help="print the datastore's metadata as JSON")
    b.set_defaults(func=cmd_build)
    i = sub.add_parser("info", help="print a datastore's metadata")
    i.add_argument("path", type=Path)
    i.set_defaults(func=cmd_info)
    p.set_defaults(func=lambda a: _usage(p))
    return p


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2


def _progress(enabled: bool, total: int, description: str):
    """A rich progress bar on stderr, or a no-op."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext(lambda n: None)

    @contextlib.contextmanager
    def bar():
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=False) as prog:
            task = prog.add_task(description, total=total or None)
            yield lambda n: prog.advance(task, n)
            prog.update(task, completed=prog.tasks[0].total or prog.tasks[0].completed)

    return bar()


def _file_texts(files: list[Path]) -> Iterator[str]:
    from .proposers.datastore import read_documents

    for f in files:
        yield from read_documents(f)


def _self_answers(a: argparse.Namespace, show: bool) -> tuple[object, list[str], dict]:
    """Generate the model's greedy answers to the workload's prompts: (model, texts, sources)."""
    from .bench.workloads import load_workload, select
    from .cli_args import load_from_args
    from .api import generate

    questions, desc = load_workload(a.workload)
    questions = select(questions, a.limit)
    if a.answer_tokens < 1:
        raise InvalidParameterError(f"--answer-tokens must be >= 1, got {a.answer_tokens}")
    model = load_from_args(a)
    chat = bool(getattr(model.tokenizer, "chat_template", None))
    texts: list[str] = []
    with _progress(show, len(questions), f"answering {len(questions)} prompts") as step:
        for q in questions:
            messages: list[dict] = []
            for turn in q.turns:
                texts.append(turn)
                if chat and q.chat:
                    messages.append({"role": "user", "content": turn})
                    prompt, use_chat = list(messages), None
                else:
                    prompt, use_chat = turn, False
                res = generate(model, prompt, chat=use_chat, max_new_tokens=a.answer_tokens, method="pld")
                texts.append(res.text)
                if chat and q.chat:
                    messages.append({"role": "assistant", "content": res.text})
            step(1)
    return model, texts, {"preset": "self-answers", "workload": desc, "questions": len(questions),
                          "answer_tokens": a.answer_tokens}


def cmd_build(a: argparse.Namespace) -> int:
    from .proposers.datastore import (DEFAULT_MAX_MB, build_datastore, corpus_files, default_path, load_tokenizer,
                            stdlib_files)

    if a.max_tokens is not None and a.max_tokens < 1:
        raise InvalidParameterError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.max_mb is not None and a.max_mb <= 0:
        raise InvalidParameterError(f"--max-mb must be > 0, got {a.max_mb}")
    if a.preset and a.files:
        raise InvalidParameterError("give corpus FILES or --preset, not both")
    if not a.preset and not a.files:
        raise InvalidParameterError("nothing to index: give corpus FILES (or directories) or --preset "
                                    f"({', '.join(PRESETS)})")
    if not a.preset and a.out is None:
        raise InvalidParameterError("--out PATH is needed when building from files")
    if a.preset != "self-answers" and (a.workload or a.limit is not None):
        raise InvalidParameterError("--workload/--limit go with --preset self-answers")
    if a.out is not None and Path(a.out).expanduser().is_dir():
        raise InvalidParameterError(f"--out {a.out} is a directory; give the path of the datastore file to write "
                                    f"(e.g. {Path(a.out) / 'datastore.npz'})")
    show = not a.no_progress
    max_mb = a.max_mb if a.max_mb is not None else (DEFAULT_MAX_MB if a.preset == "stdlib" else None)
    max_chars = int(max_mb * 1e6) if max_mb is not None else None

    t0 = time.perf_counter()
    if a.preset == "self-answers":
        model, texts, sources = _self_answers(a, show)
        tokenizer, model_name = model.tokenizer, model.name
        total = sum(len(t) for t in texts)
    else:
        if a.preset == "stdlib":
            files = stdlib_files()
            sources = {"preset": "stdlib", "root": sysconfig.get_paths()["stdlib"], "files": len(files)}
        else:
            files = corpus_files(a.files)
            if not files:
                raise InvalidParameterError(f"no corpus files found in {', '.join(map(str, a.files))}")
            sources = {"paths": [str(Path(f).expanduser().resolve()) for f in a.files], "files": len(files)}
        tokenizer, model_name = load_tokenizer(a.model)
        texts = _file_texts(files)
        total = sum(f.stat().st_size for f in files)
    if max_chars is not None:
        total = min(total, max_chars)
        sources["max_mb"] = max_mb
    if a.max_tokens is not None:
        sources["max_tokens"] = a.max_tokens
    out = check_output(a.out if a.out is not None else default_path(model_name, a.preset), "--out", directory=False)

    with _progress(show, total, f"tokenizing ({model_name})") as step:
        ds = build_datastore(texts, tokenizer, model_name, max_tokens=a.max_tokens, max_chars=max_chars,
                             sources=sources, progress=step)
    if not len(ds):
        raise InvalidParameterError("the corpus holds no text")
    path = ds.save(out)
    info = ds.describe()
    info["build_s"] = round(time.perf_counter() - t0, 3)
    if a.json:
        print(json.dumps(info))
    else:
        print(f"{path}: {info['n_tokens']:,} tokens in {info['n_docs']:,} documents, "
              f"{info['file_bytes'] / 1e6:.1f} MB, built in {info['build_s']:.1f} s "
              f"(tokenize {info['tokenize_s']:.1f} s, index {info['index_s']:.1f} s)")
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from .proposers.datastore import Datastore

    ds = Datastore.load(a.path)
    print(json.dumps({**ds.describe(), "sources": ds.meta.get("sources")}, indent=2))
    return 0


__all__ = ["add_parser", "cmd_build", "cmd_info"]
