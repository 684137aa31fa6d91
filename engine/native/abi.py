"""The kernels' C interface, read from engine/native/kernels.h: the one place it is declared.

kernels.c includes the header, so the compiler holds the C side to it; this module turns the same
text into ctypes structures and each function's argument types, so the Python side cannot drift
from it. The header keeps to a plain subset of C (see its opening comment): scalars, pointers and
nested structs in typedef'd structs, and one prototype per `adaspec_` function.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).with_name("kernels.h")

SCALARS: dict[str, type] = {
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def _ctype(base: str, stars: int, structs: dict[str, type]) -> type:
    """The ctypes type of a declaration of `base` with `stars` levels of pointer. Pointers the
    Python side fills from lists (int32 arrays) or structures are typed; any other pointer takes
    an address (a tensor's data_ptr)."""
    kind = structs.get(base) or SCALARS.get(base)
    if kind is None:
        if base != "void":
            raise ValueError(f"{HEADER.name}: unknown type {base!r}")
        kind = ctypes.c_void_p
        stars -= 1
    if stars == 0:
        return kind
    if stars == 1 and (base in structs or base == "int32_t"):
        return ctypes.POINTER(kind)
    if stars == 2:
        return ctypes.POINTER(ctypes.c_void_p)
    return ctypes.c_void_p


def _declarations(text: str) -> list[tuple[str, int, str]]:
    """(base type, pointer depth, name) of each name in comma-separated C declarations."""
    found = []
    for declaration in filter(None, (d.strip() for d in text.split(";"))):
        words = declaration.replace("*", " * ").split()
        words = [w for w in words if w != "const"]
        base, rest = words[0], " ".join(words[1:])
        for declarator in rest.split(","):
            parts = declarator.split()
            found.append((base, parts.count("*"), parts[-1]))
    return found


def read(header: Path = HEADER) -> tuple[dict[str, type], dict[str, list[type]]]:
    """The header's structures, and each function's argument types, in declaration order."""
    text = _strip_comments(header.read_text())
    structs: dict[str, type] = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", text, flags=re.S):
        fields = [(field, _ctype(base, stars, structs)) for base, stars, field in _declarations(body)]
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    functions: dict[str, list[type]] = {}
    for name, params in re.findall(r"^int (adaspec_\w+)\((.*?)\);", text, flags=re.S | re.M):
        functions[name] = [_ctype(base, stars, structs) for base, stars, _ in _declarations(params.replace(",", ";"))]
    return structs, functions


STRUCTS, FUNCTIONS = read()
Linear, Layer, Model = STRUCTS["Linear"], STRUCTS["Layer"], STRUCTS["Model"]
Cache, Batch, Context = STRUCTS["Cache"], STRUCTS["Batch"], STRUCTS["Context"]


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every function's argument and return types set from the header."""
    for name, argtypes in FUNCTIONS.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib
