"""``leapdecode doctor``: what this machine gives leapdecode, and whether its output is exact here.

It reports Python, torch and its threads; the processor and the instruction sets the kernel can
use; the C++ compiler; the kernel library (where it is cached, whether it is built and intact, the
code path it runs, and why it cannot run, with the kept compiler output of a failed build); whether
the model cache is writable; which optional extras are installed; llama.cpp's server for the bench.
Then it loads a tiny random model in the configuration ``weights="auto"`` gives a GGUF model here
and measures whether a token's logits in a tree forward are the same bits as decoding it alone
(``models/invariance.py``): the property every exact speculative method rests on.

With a MODEL (a registered name, a GGUF file or a model directory) it also says whether that
model runs on the native decoder and the exact kernel here, and whether every block type of its
GGUF runs in the file's own blocks (``models/support.py``).

``--json`` prints the report as JSON; ``--strict`` exits 1 when exactness is not guaranteed here
(for MODEL too, when one is given).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
import time

from .models.kernel_library import ISA_FLAGS as FLAGS  # the instruction sets reported


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor", help="check this machine: kernel, compiler, cache, extras, and whether output is exact here",
        description="Report what this machine gives leapdecode (Python, torch, threads, CPU instruction sets, "
                    "the C++ compiler, the quantized kernel's build and code path, the model cache, optional "
                    "extras) and check on a tiny model that the default configuration is batch-invariant "
                    "(a token's logits in a tree forward equal decoding it alone), so that speculative "
                    "methods give vanilla's tokens exactly.")
    p.add_argument("model", nargs="?", default=None,
                   help="also check this model (a registered name, a .gguf file or a model directory): does it "
                        "run on the native decoder and the exact kernel here, in its GGUF's own blocks?")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when exactness is not guaranteed on this machine")
    p.set_defaults(func=cmd_doctor)
    return p


def extras() -> dict[str, dict[str, bool]]:
    """Each optional extra of the installed package -> {requirement: installed}."""
    try:
        requires = importlib.metadata.requires("leapdecode") or []
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a bare source tree
        return {}
    out: dict[str, dict[str, bool]] = {}
    for req in requires:
        m = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        if not m or m.group(1) == "dev":
            continue
        name = re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0]
        if name == "leapdecode":
            continue  # an extra that includes another
        try:
            importlib.metadata.version(name)
            present = True
        except importlib.metadata.PackageNotFoundError:
            present = False
        out.setdefault(m.group(1), {})[name] = present
    return out


def invariance_check() -> dict:
    """The default configuration a GGUF model gets here, on a tiny random model: its weights and
    attention, why exactness is not guaranteed (None: it is), and the measured tree-vs-sequential
    mismatches (rows compared, rows that differ)."""
    import torch

    from .models.invariance import QUICK_CASES, TREE, CHAIN, exactness_problem, tree_mismatches
    from .models.loader import block_kernel, exact_kernel_problem, load

    cpu = torch.device("cpu")
    weights = "int4" if block_kernel(cpu, simd=True) else "auto"  # what weights="auto" picks for a GGUF model
    t0 = time.perf_counter()
    loaded = load("tiny-random", weights=weights)
    bad = tree_mismatches(loaded.model, QUICK_CASES)
    rows = len(QUICK_CASES) * (len(TREE) + len(CHAIN))
    problem = exactness_problem(loaded.model)
    if problem and weights != "int4" and exact_kernel_problem(cpu):
        problem += f"; the exact int4 kernel cannot run here: {exact_kernel_problem(cpu)}"
    return {"weights": loaded.weights, "attention": loaded.model.attention, "problem": problem,
            "rows_checked": rows, "rows_differing": sum(len(v) for v in bad.values()),
            "seconds": round(time.perf_counter() - t0, 2)}


def collect(model: str | None = None) -> dict:
    """The whole report (a JSON-able dict); ``model``: also whether it runs natively and exactly here."""
    import torch

    from .bench.peers.llama_server import ServerUnavailable, server_binary
    from .core.cost_model import hardware_name
    from .models.kernel_library import compiler, cpu_flags, kernel_status
    from .models.store import cache_dir, writable

    flags = set(cpu_flags().split())
    cache = cache_dir()
    try:
        llama = server_binary()
    except ServerUnavailable as e:
        llama = f"unusable: {e}"
    report = {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "cpu": {"model": hardware_name(torch.device("cpu")), "flags": [f for f in FLAGS if f in flags]},
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "compiler": compiler(),
        "kernel": kernel_status(),
        "cache": {"dir": str(cache), "writable": writable(cache)},
        "extras": extras(),
        "llama_server": str(llama) if llama else None,
    }
    report["default"] = invariance_check()
    report["exact"] = report["default"]["problem"] is None and report["default"]["rows_differing"] == 0
    if model is not None:
        from .models.support import support_of

        report["model"] = support_of(model).to_dict()
        report["exact"] = report["exact"] and report["model"]["exact"]
    return report


def _last_lines(path: str, n: int = 3) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip() for line in f.read().strip().splitlines()[-n:]]
    except OSError:
        return []


def print_report(r: dict, out=None) -> None:
    out = out or sys.stdout

    def line(label: str, value: str, mark: str = " ") -> None:
        print(f"{mark} {label:<22} {value}", file=out)

    ok, bad = "✓", "✗"
    k, d = r["kernel"], r["default"]
    line("python", f"{r['python']} ({r['platform']})")
    line("torch", f"{r['torch']}, {r['threads']} thread{'s' if r['threads'] != 1 else ''} on {r['cpus']} CPUs"
         + (f"; CUDA: {r['cuda']}" if r["cuda"] else ""))
    line("processor", f"{r['cpu']['model']}; {' '.join(r['cpu']['flags']) or 'none of ' + ', '.join(FLAGS)}")
    prebuilt = k["variant"].startswith("the package's")
    line("C++ compiler", r["compiler"] or ("none found (not needed: the package ships its kernel built)" if prebuilt else
                                           "none found (set CXX or install g++): the exact kernel cannot build"),
         ok if r["compiler"] or prebuilt else bad)
    if k["problem"] is None:
        line("kernel", f"{k['variant']}: {k['isa']} path, {k['library']}", ok)
    else:
        line("kernel", f"cannot run: {k['problem']}", bad)
    if k["build_log"]:
        line("last failed build", k["build_log"], bad)
        for text in _last_lines(k["build_log"]):
            print(f"    {text}", file=out)
    line("model cache", f"{r['cache']['dir']} ({'writable' if r['cache']['writable'] else 'NOT writable'})",
         ok if r["cache"]["writable"] else bad)
    for name, reqs in r["extras"].items():
        missing = [n for n, present in reqs.items() if not present]
        line(f"extra [{name}]", "installed" if not missing else f"missing {', '.join(missing)}",
             ok if not missing else "-")
    line("llama.cpp server", r["llama_server"] or "not built (`leapdecode bench --peers llama-server` builds it)")
    config = f"weights {d['weights']}, attention {d['attention']}"
    measured = (f"{d['rows_differing']} of {d['rows_checked']} tree rows differ from decoding alone "
                f"(tiny model, {d['seconds']} s)")
    machine_exact = d["problem"] is None and d["rows_differing"] == 0
    if machine_exact:
        line("exact speculation", f"guaranteed: {config}; measured: {measured}", ok)
    else:
        why = d["problem"] or "the batch-invariance check failed"
        line("exact speculation", f"NOT guaranteed: {why} ({config}; measured: {measured})", bad)
    m = r.get("model")
    if m is not None:
        from .models.support import Support

        support = Support(**{k: v for k, v in m.items() if k != "exact"})
        print(f"\nmodel {support.model}", file=out)
        for label, text, good in support.lines():
            line(label, text, ok if good else bad)


def cmd_doctor(a: argparse.Namespace) -> int:
    report = collect(a.model)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 1 if a.strict and not report["exact"] else 0
