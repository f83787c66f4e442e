"""The kernel library's ABI in Python, derived from its one declaration (``kernels/ld_abi.h``): the
functions' ``ctypes`` argument and result types, the structs as ``ctypes.Structure``s, and the version
the library must report (issue 64: the ABI was written three times, in each ``.cpp``, again in
``layers.cpp`` and as hand-typed ``argtypes``).

The header is written in a small subset of C that ``parse`` reads: struct definitions of plain members
(``type a, b;``) and function prototypes ending in ``;``; types ``int``, ``int64_t``, ``float``, ``void``,
pointers (to a struct of the header: a pointer to it; to anything else: ``c_void_p``) and the structs.
The compiler checks every definition in the sources against the header (each includes it); ``bind``
checks the library's version and each struct's size against it.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import lru_cache

from .kernel_build import ABI_HEADER

HEADER = ABI_HEADER
SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "uint8_t": ctypes.c_uint8,
           "uint16_t": ctypes.c_uint16}


class AbiMismatch(RuntimeError):
    """A library whose ABI is not the header's (another version, or a struct of another size)."""


@dataclass(frozen=True)
class Abi:
    version: int
    structs: dict[str, type]  # name -> ctypes.Structure subclass, in the header's order
    functions: dict[str, tuple[object, list]]  # name -> (restype, argtypes)


def _declarations(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)  # preprocessor lines (#pragma, #define, #ifdef)


def _ctype(spec: str, structs: dict[str, type]):
    """A declared type (``const uint16_t*``, ``int64_t``, ``LdLinear``, ``const LdStack*``) as ctypes."""
    spec = spec.replace("const", " ").strip()
    pointer = spec.endswith("*")
    base = spec.rstrip("*").strip()
    if spec.count("*") > 1:
        raise ValueError(f"ld_abi.h: {spec!r}: pointers to pointers are not in the subset")
    if pointer:
        return ctypes.POINTER(structs[base]) if base in structs else ctypes.c_void_p
    if base == "void":
        return None
    if base in structs:
        return structs[base]
    if base not in SCALARS:
        raise ValueError(f"ld_abi.h: unknown type {base!r}")
    return SCALARS[base]


def _split_declarator(decl: str) -> tuple[str, str]:
    """``const uint16_t* x`` -> (``const uint16_t*``, ``x``)."""
    m = re.fullmatch(r"\s*(.*?[\s*])(\w+)\s*", decl)
    if not m:
        raise ValueError(f"ld_abi.h: cannot read {decl!r}")
    return m.group(1).strip(), m.group(2)


def parse(text: str) -> Abi:
    """The ABI that a header's text declares."""
    version = re.search(r"#define\s+LD_ABI_VERSION\s+(\d+)", text)
    if not version:
        raise ValueError("ld_abi.h: no LD_ABI_VERSION")
    body = _declarations(text)
    structs: dict[str, type] = {}
    for name, members in re.findall(r"struct\s+(\w+)\s*\{(.*?)\};", body, flags=re.S):
        fields = []
        for member in filter(str.strip, members.split(";")):
            first, *more = member.split(",")
            spec, field = _split_declarator(first)
            base = spec.rstrip("*").strip() if "*" in spec else spec
            fields.append((field, _ctype(spec, structs)))
            fields += [(n.strip(), _ctype(base, structs)) for n in more]
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"``ld_abi.h``'s {name}."})
    rest = re.sub(r"struct\s+\w+\s*\{.*?\};", " ", body, flags=re.S).replace('extern "C" {', " ")
    functions = {}
    for ret, name, params in re.findall(r"([\w\s*]+?)\s*\b(ld_\w+)\s*\(([^)]*)\)\s*;", rest):
        params = params.strip()
        args = [] if params in ("", "void") else [_ctype(_split_declarator(p)[0], structs) for p in params.split(",")]
        restype = ctypes.c_char_p if ret.strip() == "const char*" else _ctype(ret, structs)
        functions[name] = (restype, args)
    return Abi(int(version.group(1)), structs, functions)


@lru_cache(maxsize=None)
def abi() -> Abi:
    """The installed header's ABI."""
    return parse(HEADER.read_text())


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Type every function of the ABI on ``lib`` and check it is the header's: ``AttributeError`` where a
    function is missing (not this project's library), ``AbiMismatch`` where its version or a struct's
    size differs (a library built from other sources)."""
    a = abi()
    for name, (restype, argtypes) in a.functions.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    got = lib.ld_abi_version()
    if got != a.version:
        raise AbiMismatch(f"the kernel library has ABI version {got}, the package's header {a.version}")
    for name, struct in a.structs.items():
        size = lib.ld_abi_sizeof(name.encode())
        if size != ctypes.sizeof(struct):
            raise AbiMismatch(f"the kernel library's {name} is {size} bytes, the package's header's {ctypes.sizeof(struct)}")
    return lib
