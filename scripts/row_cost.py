#!/usr/bin/env python
"""What a verified row costs on each instruction-set variant of the kernel this CPU runs (issue 64): the
engine's own verification profile (``measure_verify_cost``: a forward of n tree nodes at a prompt's
context, the median ratio to one row times one row's fastest time) of a registered model on each
variant, in one process, the rounds interleaved across the variants.

The variants are the ones a wheel ships (``models/kernel_build.py``: AMX, AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2; the portable one is
left out, the loader never runs it by default), compiled here into a temporary folder, each used for every
kernel call (products, attention, the layer stack) in turn; the first-use ``-march=native`` build is
measured beside them.  Every variant gives the same bits (tests/test_kernel_build.py, tests/test_qkernel.py),
so only the time differs.

    python scripts/row_cost.py --rows 1,2,4,8,16,32            # print
    python scripts/row_cost.py --save                          # and docs/results/row_cost/DATE-MACHINE.json

With the verified rows, the int8 multiply-add peak of each instruction the variants use and the memory
bandwidth (``scripts/isa_peak.cpp``, on the same threads), so the page shows how near each is to its limit.

``leapdecode results`` draws the results page's row-cost section from the saved reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


PEAK_SOURCE = Path(__file__).with_name("isa_peak.cpp")
PEAK_TESTS = {"vnni512": "avx512_vnni", "vnni256": "avx_vnni", "avx2": "avx2", "amx": "amx_int8"}  # test -> CPU flag
# the isa_peak test whose instruction bounds each code paths products (kernel_library.kernel_isa, variant names)
PEAK_OF_PATH = {"amx": "amx", "avx512-vnni": "vnni512", "avx2-vnni": "vnni256", "avx2": "avx2"}


def measure_peaks(cxx: str, flags: set[str]) -> dict:
    """The int8 multiply-add peak of each instruction this CPU has and the memory bandwidth, on torch's threads
    (``isa_peak.cpp``, compiled here)."""
    import json
    import subprocess

    tests = [t for t, flag in PEAK_TESTS.items() if flag in flags] + ["read", "copy"]
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "isa_peak"
        subprocess.run([cxx, "-O3", "-fopenmp", "-std=c++17", str(PEAK_SOURCE), "-o", str(exe)], check=True)
        print(f"measuring the peaks of {', '.join(tests)} ...", file=sys.stderr)
        out = subprocess.run([str(exe), str(torch.get_num_threads()), *tests], check=True, capture_output=True,
                             text=True, timeout=600).stdout
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="a registered model (default %(default)s)")
    ap.add_argument("--rows", default="1,2,4,8,16,32", help="verified rows, comma-separated (default %(default)s)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the rows (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=7,
                    help="rounds of the profile, each over every variant in turn (default %(default)s)")
    ap.add_argument("--save", action="store_true", help="write the report to docs/results/row_cost/ for the results page")
    ap.add_argument("--no-peaks", action="store_true",
                    help="leave out the instructions' measured peaks and the memory bandwidth (scripts/isa_peak.cpp)")
    args = ap.parse_args()
    import ctypes

    import leapdecode
    from leapdecode.core.cost_model import machine_description, measure_verify_cost
    from leapdecode.models import kernel_abi, kernel_build, kernel_library

    sizes = tuple(int(r) for r in args.rows.split(","))
    flags = set(kernel_library.cpu_flags().split())
    if kernel_library.kernel_problem() is not None:
        raise SystemExit(f"the kernel is not available here: {kernel_library.kernel_problem()}")
    cxx = kernel_library.compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler to build the variants")
    libs = {"native (-march=native)": kernel_library.library()}
    # the instruction whose peak bounds the native build's products (before the loop below swaps libraries)
    native_isa = PEAK_OF_PATH.get(kernel_library.kernel_isa())
    with tempfile.TemporaryDirectory() as tmp:
        runnable = tuple(n for n, _, needs in kernel_build.VARIANTS if n != "portable" and set(needs) <= flags)
        print(f"building the variants {', '.join(runnable)} ...", file=sys.stderr)
        kernel_build.build_prebuilt(cxx, Path(tmp), say=lambda s: print(s, file=sys.stderr), names=runnable)
        for name in runnable:
            libs[name] = kernel_abi.bind(ctypes.CDLL(str(Path(tmp) / f"qgemm-{name}.so")))
        lm = leapdecode.load(args.model)
        model = lm.model
        ids = torch.randint(100, 20000, (args.context,), generator=torch.Generator().manual_seed(0))
        cache = model.new_cache(max_len=args.context + max(sizes) + 8)
        for start in range(0, args.context, 64):  # (the same bits on every variant: one cache serves them all)
            model.forward(ids[start:start + 64].view(1, -1), cache)
            cache.commit()
        # rounds interleaved across the variants, so that a burst of load elsewhere (these machines' neighbours
        # moved timings by up to 1.5x within minutes) hits every variant alike, not one of them
        rounds: dict[str, list[list[float]]] = {name: [] for name in libs}
        measured = sizes
        for _ in range(args.repeats):
            for name, lib in libs.items():
                kernel_library.library = lambda lib=lib: lib  # every kernel call of the model looks the library up
                cost = measure_verify_cost(lm, cache, sizes=sizes, repeats=1)
                measured = tuple(cost.sizes)
                rounds[name].append([cost.profile(n) for n in measured])
        results = {}
        for name, rs in rounds.items():  # as measure_verify_cost: the median ratio to one row, times one row's fastest
            base = min(r[0] for r in rs)
            results[name] = {str(n): round(1000 * base * statistics.median(r[i] / r[0] for r in rs), 2)
                             for i, n in enumerate(measured)}
            one = results[name][str(measured[0])]
            print(f"{name:>24}: " + "  ".join(f"{n} rows {results[name][str(n)]:.1f} ms ({results[name][str(n)] / one:.2f}x)"
                                              for n in measured), flush=True)
    machine = machine_description(torch.device("cpu"))
    from leapdecode.models.qkernel import QPart

    parts = [m for m in model.modules() if isinstance(m, QPart)]
    macs = sum(p.in_features * p.out_features for p in parts)  # a row's multiply-adds in the packed linears
    nbytes = sum(b.numel() * b.element_size() for p in parts for b in p.buffers())
    # the instruction whose peak bounds each variant's products (scripts/isa_peak.cpp's tests)
    isa = {name: PEAK_OF_PATH.get(name, native_isa) for name in results}  # (the native build: its own path)
    peaks = None if args.no_peaks else measure_peaks(cxx, flags)
    report = {"report": "row-cost", "machine": machine, "cpu_flags": kernel_library.isa_flags(), "model": args.model,
              "context": args.context, "date": time.strftime("%Y-%m-%d"), "variants": results,
              "macs_per_row": macs, "weight_bytes": nbytes, "isa": isa,
              "peaks": peaks, "command": "python scripts/row_cost.py " + " ".join(sys.argv[1:])}
    if args.save:
        from leapdecode.results.page import RESULTS_DIR, ROW_COST_DIR, slug
        from leapdecode.models.store import atomic_write

        path = RESULTS_DIR / ROW_COST_DIR / f"{report['date']}-{slug(machine.split(',')[0])}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(report, indent=1) + "\n")
        print(f"saved {path} (run `leapdecode results` to redraw the page)", file=sys.stderr)
    else:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
