"""The other builds of a kernel source (portable C++, AVX2, AVX2 with VNNI, AVX-512 without AMX), compiled
and loaded to compare with the kernel library (tests/test_qkernel.py, test_attention_kernel.py).  Apart
from helpers/kernels.py, which needs the optional ``gguf`` package."""

from __future__ import annotations

import pytest

# The other builds of a kernel source that tests compare with the library, by name: the
# portable C++ path, the AVX2 path (AVX-512 and AVX-VNNI switched off, so an AVX-512 machine checks it too),
# on a CPU with AVX-VNNI the AVX2 path with it (qgemm.cpp only), and on a CPU where the library runs AMX
# tiles, its AVX-512 path without them (qgemm.cpp only).
KERNEL_VARIANTS = {"portable": ("-DLD_PORTABLE",), "avx2": ("-mno-avx512f", "-mno-avxvnni"),
                   "avx2-vnni": ("-mno-avx512f", "-mavxvnni"), "no-amx": ("-DLD_NO_AMX",)}


def build_kernel_variant(tmp_path_factory, source, functions: tuple[str, ...], variant: str = "portable"):
    """``source`` (one of ``kernel_library.SOURCES``) built with kernel_library's compiler and flags plus those
    of ``KERNEL_VARIANTS[variant]``, loaded, with ``functions`` typed as in the real library;
    skips where no compiler or kernel is available, or (``"avx2"``) the CPU has no AVX2, FMA and
    F16C to run that path.  On a CPU with AVX2 and no AVX-512 the library itself is the AVX2
    build (``-march=native`` there implies ``-mno-avx512f``): it is returned instead of compiling
    the same code again (about a minute for qgemm.cpp on 2 cores)."""
    import ctypes
    import subprocess

    from leapdecode.models import kernel_library

    problem = kernel_library.kernel_problem()
    if problem is not None:
        pytest.skip(f"the kernels are not available here: {problem}")
    cxx = kernel_library.compiler()
    if cxx is None:
        pytest.skip(f"no C++ compiler to build the {variant} kernel")
    flags = set(kernel_library.cpu_flags().split())
    if variant == "avx2" and not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX2 (with FMA and F16C): the AVX2 path cannot run here")
    if variant == "avx2" and not {"avx512f", "avx_vnni"} & flags:
        return kernel_library.library()
    assert variant not in ("avx2-vnni", "no-amx") or source == kernel_library.SOURCE, "only qgemm.cpp has that path"
    if variant == "avx2-vnni" and "avx_vnni" not in flags:
        pytest.skip("this CPU has no AVX-VNNI: the avx2-vnni path cannot run here")
    if variant == "avx2-vnni" and "avx512f" not in flags:
        return kernel_library.library()
    if variant == "no-amx" and not kernel_library.library().ld_amx():
        pytest.skip("the library runs no AMX tiles here: its AVX-512 path is the library's own")
    target = tmp_path_factory.mktemp(variant) / f"{source.stem}-{variant}.so"
    proc = subprocess.run([cxx, *kernel_library.CXXFLAGS, *KERNEL_VARIANTS[variant], str(source), "-o", str(target)],
                          capture_output=True, text=True, timeout=kernel_library.BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(target))
    ref = kernel_library.library()
    for name in functions:
        getattr(lib, name).argtypes = getattr(ref, name).argtypes
        getattr(lib, name).restype = getattr(ref, name).restype
    return lib
