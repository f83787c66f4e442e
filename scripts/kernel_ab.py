"""Two builds of the quantized kernel (``models/kernels/qgemm.cpp``) against each other in one
process, alternating, so that a noisy machine shifts both alike: build A from a git revision or a
file, build B from the working tree (each with optional extra compiler flags, e.g. ``-DPREFETCH_GROUPS=8``).

``layers`` mode: every linear layer of the model, then the head, at each row count (min over
rounds), ms.  ``cached`` mode: one small layer (block 0's ``wo``) called 20 times in a row, so its
weights stay in cache: the kernel's compute alone, in ns per 16-column unit and group (use
``--threads 1``).  ``generate`` mode: greedy generations of three fixed prompts with each build,
tokens/s per round, and whether the two builds gave the same tokens (they must: the kernel's
arithmetic is documented and tested bit for bit).

    python scripts/kernel_ab.py layers --a ec0bb9d --rows 1,2,4,8,16
    python scripts/kernel_ab.py layers --a HEAD --bflags=-DRB_ROWS=8 --rows 8,12,16,24
    python scripts/kernel_ab.py generate --a ec0bb9d --new 96 --rounds 4
    python scripts/kernel_ab.py cached --a ec0bb9d --rows 1,2,4,8,16 --rounds 7 --threads 1

A revision whose kernel predates scale mode 3 (Q6_K without offsets, this session) rejects it:
pass ``--a`` a copy of its qgemm.cpp whose mode check accepts 3 (modes 2 and 3 compute the same).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import leapdecode
from leapdecode.models import kernel_library
from leapdecode.models.quant import BLOCK_LINEARS

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def quicksort(arr):\n", "Explain how a hash map works in two paragraphs.\n",
           "import numpy as np\n\ndef softmax(x):\n"]
FUNCS = ("ld_qgemm", "ld_qdequant", "ld_qdequant_bf16", "ld_attend_rows", "ld_rmsnorm_bf16", "ld_rope_store",
         "ld_decoder_layers", "ld_layers_scratch", "ld_silu_mul_bf16",
         "ld_work_bytes", "ld_simd")


def source(spec: str | None, work: Path, name: str) -> Path:
    """qgemm.cpp of the working tree (None), of a file, or of a git revision."""
    if spec is None:
        return kernel_library.SOURCES[0]
    if os.path.exists(spec):
        return Path(spec)
    out = work / f"{name}.cpp"
    out.write_text(subprocess.check_output(["git", "-C", str(ROOT), "show", f"{spec}:src/leapdecode/models/kernels/qgemm.cpp"],
                                           text=True))
    return out


def build(src: Path, flags: str, out: Path) -> ctypes.CDLL:
    """The kernel library from ``src`` (plus the tree's other sources), typed like kernel_library's."""
    # (-I: the tree's bf16.h for a revision's source copied elsewhere)
    subprocess.check_call(["g++", *kernel_library.CXXFLAGS, *flags.split(), f"-I{kernel_library.SOURCE.parent}",
                           str(src), *map(str, kernel_library.SOURCES[1:]), "-o", str(out)])
    ref = kernel_library.library()
    lib = ctypes.CDLL(str(out))
    for name in FUNCS:
        getattr(lib, name).argtypes = getattr(ref, name).argtypes
        getattr(lib, name).restype = getattr(ref, name).restype
    return lib


def use(lib: ctypes.CDLL) -> None:
    kernel_library.library = lambda: lib  # QLinear looks the library up on every call


def layers_mode(a, libs, model) -> None:
    layers = [getattr(b, n) for b in model.layers for n in BLOCK_LINEARS]
    head = model.lm_head
    rows = [int(r) for r in a.rows.split(",")]
    xs = {m: {n: torch.randn(m, n).to(torch.bfloat16) for n in {l.in_features for l in layers + [head]}} for m in rows}
    best: dict = {}
    for r in range(a.rounds):
        for m in rows:
            for tag in ("AB" if r % 2 == 0 else "BA"):
                use(libs[tag])
                t0 = time.perf_counter()
                for layer in layers:
                    layer.rowwise(xs[m][layer.in_features])
                t1 = time.perf_counter()
                head.rowwise(xs[m][head.in_features])
                t2 = time.perf_counter()
                cur = ((t1 - t0) * 1e3, (t2 - t1) * 1e3)
                best[tag, m] = min(best.get((tag, m), cur), cur, key=sum)
    print("| rows | A layers ms | A head ms | B layers ms | B head ms | B/A total |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        (la, ha), (lb, hb) = best["A", m], best["B", m]
        print(f"| {m} | {la:.1f} | {ha:.1f} | {lb:.1f} | {hb:.1f} | {(lb + hb) / (la + ha):.3f} |")


def cached_mode(a, libs, model) -> None:
    layer = model.layers[0].wo
    units = sum((p.out_features // 16) * (p.in_features // p.group) for p in layer.parts)
    rows = [int(r) for r in a.rows.split(",")]
    best: dict = {}
    for r in range(a.rounds):
        for m in rows:
            x = torch.randn(m, layer.in_features).to(torch.bfloat16)
            for tag in ("AB" if r % 2 == 0 else "BA"):
                use(libs[tag])
                layer.rowwise(x)
                t = time.perf_counter()
                for _ in range(20):
                    layer.rowwise(x)
                ns = (time.perf_counter() - t) / 20 / units * 1e9 * torch.get_num_threads()
                best[tag, m] = min(best.get((tag, m), ns), ns)
    print("| rows | A ns per unit and group | B | B/A |")
    print("|---:|---:|---:|---:|")
    for m in rows:
        print(f"| {m} | {best['A', m]:.1f} | {best['B', m]:.1f} | {best['B', m] / best['A', m]:.3f} |")


def generate_mode(a, libs, loaded) -> None:
    rates: dict = {"A": [], "B": []}
    tokens: dict = {}
    for r in range(a.rounds):
        for tag in ("AB" if r % 2 == 0 else "BA"):
            use(libs[tag])
            n, dt, out = 0, 0.0, []
            for p in PROMPTS:
                t = time.perf_counter()
                res = leapdecode.generate(loaded, p, max_new_tokens=a.new, method=a.method)
                dt += time.perf_counter() - t
                n += len(res.tokens)
                out.append(list(res.tokens))
            rates[tag].append(n / dt)
            tokens[tag] = out
    fmt = lambda v: " ".join(f"{x:.1f}" for x in v)  # noqa: E731
    print(f"{a.method}: A {fmt(rates['A'])} | B {fmt(rates['B'])} tokens/s | best B/A {max(rates['B']) / max(rates['A']):.3f}"
          f" | same tokens: {tokens['A'] == tokens['B']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("layers", "cached", "generate"))
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--a", default="HEAD", help="build A: a git revision or a qgemm.cpp file (default HEAD)")
    ap.add_argument("--b", default=None, help="build B: a qgemm.cpp file (default: the working tree's)")
    ap.add_argument("--aflags", default="", help="extra compiler flags of build A")
    ap.add_argument("--bflags", default="", help="extra compiler flags of build B")
    ap.add_argument("--rows", default="1,2,4,8,16", help="layers mode: row counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=96, help="generate mode: new tokens per prompt")
    ap.add_argument("--method", default="vanilla", help="generate mode: the decoding method")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        work = Path(tmp)
        libs = {"A": build(source(a.a, work, "A"), a.aflags, work / "A.so"),
                "B": build(source(a.b, work, "B"), a.bflags, work / "B.so")}
        loaded = leapdecode.load(a.model)
        print(f"{a.model}, {torch.get_num_threads()} threads; A = {a.a} {a.aflags}, B = {a.b or 'working tree'} {a.bflags}")
        if a.mode == "layers":
            layers_mode(a, libs, loaded.model)
        elif a.mode == "cached":
            cached_mode(a, libs, loaded.model)
        else:
            generate_mode(a, libs, loaded)


if __name__ == "__main__":
    main()
