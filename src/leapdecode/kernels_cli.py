"""``leapdecode kernels``: the quantized kernel library on this machine, and building it on purpose.

``leapdecode kernels`` says which library the engine uses here (a prebuilt variant a wheel ships, chosen for
this CPU, or the build for this CPU in the cache), its code path (``amx``, ``avx512-vnni``, ``avx2``,
``portable``: the same bits on each) and each prebuilt variant with whether this CPU runs it.
``leapdecode kernels build --native`` compiles the library for this CPU (``-march=native``) into the cache
now, instead of at first use; ``leapdecode kernels build --variants --out DIR`` compiles the instruction-set
variants a package build ships (``models/kernel_build.py``) into DIR.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import InvalidParameterError
from .models import kernel_build, kernel_library


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "kernels", help="the quantized kernel library here: which variant runs, and building it (build --native)",
        description="Show which build of the quantized kernel library the engine uses on this machine (a prebuilt "
                    "instruction-set variant shipped in the package, or the build for this CPU in the cache), its "
                    "code path, and every prebuilt variant with whether this CPU runs it.  `kernels build --native` "
                    "compiles the library for this CPU now (LEAPDECODE_KERNEL=native then uses it where the package "
                    "ships variants); `kernels build --variants --out DIR` compiles the variants a wheel ships.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    sub = p.add_subparsers(dest="kernels_command")
    b = sub.add_parser("build", help="compile the kernel library: --native (this CPU, into the cache) or --variants",
                       description="Compile the kernel library now.  --native: for this CPU (-march=native) into the "
                                   "cache, where a source checkout (and LEAPDECODE_KERNEL=native) takes it.  "
                                   "--variants: the instruction-set variants a package build ships, into --out.")
    what = b.add_mutually_exclusive_group(required=True)
    what.add_argument("--native", action="store_true", help="build for this CPU into the cache")
    what.add_argument("--variants", nargs="*", metavar="NAME",
                      help="build these prebuilt variants (none named: all of "
                           f"{', '.join(n for n, _, _ in kernel_build.VARIANTS)}) into --out")
    b.add_argument("--out", type=Path, default=None, help="the folder for --variants (qgemm-<name>.so and manifest.json)")
    b.add_argument("--force", action="store_true", help="--native: build again even where an intact build is cached")
    p.set_defaults(func=cmd_kernels)
    return p


def report() -> dict:
    """What ``leapdecode kernels`` shows."""
    flags = set(kernel_library.cpu_flags().split())
    status = kernel_library.kernel_status()
    variants = []
    shipped = kernel_build.shipped_variants()
    for name, cflags, needs in kernel_build.VARIANTS:
        variants.append({"name": name, "flags": list(cflags), "runs_here": set(needs) <= flags,
                         "missing_cpu_flags": sorted(set(needs) - flags), "shipped": name in shipped})
    return {"in_use": status["variant"], "library": status["library"], "isa": status["isa"],
            "problem": status["problem"], "compiler": status["compiler"], "variants": variants}


def cmd_kernels(a: argparse.Namespace) -> int:
    if a.kernels_command == "build":
        return _build(a)
    r = report()
    if a.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"in use:   {r['in_use']}" + (f": the {r['isa']} path" if r["isa"] else ""))
    print(f"library:  {r['library']}")
    if r["problem"]:
        print(f"problem:  {r['problem']}")
    print(f"compiler: {r['compiler'] or 'none'}")
    print("variants (best first; every one computes the same bits):")
    for v in r["variants"]:
        runs = "runs here" if v["runs_here"] else "not on this CPU (lacks " + ", ".join(v["missing_cpu_flags"]) + ")"
        print(f"  {v['name']:<12} {'shipped' if v['shipped'] else 'not shipped':<12} {runs}")
    return 0


def _build(a: argparse.Namespace) -> int:
    if a.native:
        if a.out is not None:
            raise InvalidParameterError("--out goes with --variants (--native builds into the cache)")
        path = kernel_library.build_native(force=a.force)
        print(f"built {path}")
        return 0
    names = tuple(a.variants) or None
    known = [n for n, _, _ in kernel_build.VARIANTS]
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise InvalidParameterError(f"unknown variant {', '.join(unknown)}: expected some of {', '.join(known)}")
    if a.out is None:
        raise InvalidParameterError("--variants needs --out DIR (the folder for the libraries and manifest.json)")
    if a.force:
        raise InvalidParameterError("--force goes with --native")
    cxx = kernel_library.compiler()
    if cxx is None:
        raise InvalidParameterError("no C++ compiler (g++, c++ or clang++; or $CXX) to build the variants")
    manifest = kernel_build.build_prebuilt(cxx, a.out, names=names)
    print(f"built {', '.join(manifest['variants'])} into {a.out}")
    return 0
