"""The kernel library's ABI declared once (``kernels/ld_abi.h``) and the Python binding derived from it
(``models/kernel_abi.py``), issue 64."""

from __future__ import annotations

import ctypes
import re
from types import SimpleNamespace

import pytest

from leapdecode.models import kernel_abi, kernel_library, qkernel


def test_the_header_declares_every_exported_function_of_the_sources():
    defined = set()
    for src in kernel_library.SOURCES:
        defined |= set(re.findall(r'extern "C"\s+[\w\s*]+?\b(ld_\w+)\s*\(', src.read_text()))
    assert defined == set(kernel_abi.abi().functions)
    # and no source declares a function or struct of the ABI again (the header is the one place)
    for src in kernel_library.SOURCES:
        text = src.read_text()
        assert '#include "ld_abi.h"' in text, src.name
        assert not re.search(r"^struct\s+Ld\w+\s*\{", text, flags=re.M), src.name
        assert not re.search(r'^extern "C"[^{]*\)\s*;', text, flags=re.M), src.name


def test_the_binding_is_the_headers():
    a = kernel_abi.abi()
    restype, argtypes = a.functions["ld_qgemm"]
    assert restype is ctypes.c_int and len(argtypes) == 21
    assert argtypes[:4] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    assert a.functions["ld_work_bytes"] == (ctypes.c_int64, [ctypes.c_int64, ctypes.c_int])
    assert a.functions["ld_simd"] == (ctypes.c_int, [])
    restype, argtypes = a.functions["ld_decoder_layers"]
    assert argtypes[0] is ctypes.POINTER(a.structs["LdStack"]) and argtypes[1] is ctypes.POINTER(a.structs["LdLayer"])
    part = a.structs["LdPart"]
    assert [n for n, _ in part._fields_] == ["codes", "scales", "zeros", "dsup", "zsup", "bias", "smode", "gps", "bits",
                                             "offset", "group", "n", "n0"]
    assert dict(a.structs["LdLinear"]._fields_)["parts"] is ctypes.POINTER(part)
    assert dict(a.structs["LdLayer"]._fields_)["qkv"] is a.structs["LdLinear"]
    assert dict(a.structs["LdStack"]._fields_)["softcap"] is ctypes.c_float
    assert qkernel.LdStack is a.structs["LdStack"]


def test_the_library_reports_the_headers_version_and_struct_sizes():
    problem = kernel_library.kernel_problem()
    if problem is not None:
        pytest.skip(f"the kernel is not available here: {problem}")
    lib = kernel_library.library()
    a = kernel_abi.abi()
    assert lib.ld_abi_version() == a.version
    for name, struct in a.structs.items():
        assert lib.ld_abi_sizeof(name.encode()) == ctypes.sizeof(struct) > 0, name
    assert lib.ld_abi_sizeof(b"NoSuchStruct") == -1


class _Fn:
    def __init__(self, value):
        self.value = value

    def __call__(self, *args):
        return self.value(*args) if callable(self.value) else self.value


def _fake_library(version: int, sizes: dict[str, int]) -> SimpleNamespace:
    lib = SimpleNamespace(**{name: _Fn(0) for name in kernel_abi.abi().functions})
    lib.ld_abi_version = _Fn(version)
    lib.ld_abi_sizeof = _Fn(lambda name: sizes.get(name.decode(), -1))
    return lib


def test_bind_refuses_another_version_or_struct_layout():
    a = kernel_abi.abi()
    sizes = {n: ctypes.sizeof(s) for n, s in a.structs.items()}
    kernel_abi.bind(_fake_library(a.version, sizes))  # the header's: accepted
    with pytest.raises(kernel_abi.AbiMismatch, match="ABI version"):
        kernel_abi.bind(_fake_library(a.version + 1, sizes))
    with pytest.raises(kernel_abi.AbiMismatch, match="LdStack"):
        kernel_abi.bind(_fake_library(a.version, {**sizes, "LdStack": sizes["LdStack"] - 8}))
    missing = _fake_library(a.version, sizes)
    del missing.ld_qgemm
    with pytest.raises(AttributeError):
        kernel_abi.bind(missing)


def test_parse_reads_the_subset_and_refuses_the_rest():
    text = """#define LD_ABI_VERSION 7
    // a comment
    struct A { int64_t n, m; const float* p; };
    struct B { A a; const A* pa; float f; };
    /* a block
       comment */
    int ld_one(const B* b, int64_t n,
               void* out);
    int64_t ld_two(void);
    """
    a = kernel_abi.parse(text)
    assert a.version == 7 and list(a.structs) == ["A", "B"]
    assert a.structs["A"]._fields_ == [("n", ctypes.c_int64), ("m", ctypes.c_int64), ("p", ctypes.c_void_p)]
    assert a.structs["B"]._fields_[0] == ("a", a.structs["A"])
    assert a.functions == {"ld_one": (ctypes.c_int, [ctypes.POINTER(a.structs["B"]), ctypes.c_int64, ctypes.c_void_p]),
                           "ld_two": (ctypes.c_int64, [])}
    with pytest.raises(ValueError, match="unknown type"):
        kernel_abi.parse("#define LD_ABI_VERSION 1\nint ld_x(double d);")
    with pytest.raises(ValueError, match="LD_ABI_VERSION"):
        kernel_abi.parse("int ld_x(int d);")
