"""Writes tests/uccl_api.txt: every name UCCL's p2p module exports, with its parameters, read
from the nanobind bindings (``p2p/engine_api.cc``) of an upstream commit.

    git -C UCCL_REPO show COMMIT:p2p/engine_api.cc \\
        | python3 tests/uccl_api_extract.py COMMIT "$(git -C UCCL_REPO log -1 --format=%cs COMMIT)" \\
        > tests/uccl_api.txt

Lines (tests/test_uccl_api.py reads them):

    function NAME(PARAMS)            module function
    class NAME                       class
    attribute CLASS.NAME             data member
    enum NAME MEMBER...              enum (its members are exported at module level too)
    method CLASS.NAME(PARAMS)        method (one line per overload)
    staticmethod CLASS.NAME(PARAMS)  static method

PARAMS are the ``nb::arg`` names in order, ``name=default`` where a default is given
(``Type::value`` written ``Type.value``).
"""

from __future__ import annotations

import re
import sys

BINDING = re.compile(
    r'(?P<kind>m\.def|\.def_static|\.def_prop_rw|\.def_ro|\.def_rw|\.def|'
    r'nb::class_<[\w:]+>\(m,|nb::enum_<[\w:]+>\(m,|\.value)\(?\s*"(?P<name>\w+)"'
    # A constructor bound from the C++ one: `.def(nb::init<Args...>())`.
    r'|(?P<init>\.def\(nb::init<(?P<types>[^>]*)>\(\)\))'
)
ARG = re.compile(r'nb::arg\("(?P<name>\w+)"\)(?:\s*=\s*(?P<default>[^,)\n]+))?')
LAMBDA = re.compile(r"\[[^\]]*\]\s*\(")


def lambda_arity(segment: str) -> int | None:
    """Parameters of the segment's lambda beyond ``self``, or None without a lambda."""
    m = LAMBDA.search(segment)
    if m is None:
        return None
    depth, i, commas, empty = 1, m.end(), 0, True
    while i < len(segment) and depth:
        c = segment[i]
        if c in "(<":
            depth += 1
        elif c in ")>":
            depth -= 1
        elif c == "," and depth == 1:
            commas += 1
        elif not c.isspace():
            empty = False
        i += 1
    params = 0 if empty else commas + 1
    return max(params - 1, 0)


def params_of(segment: str, is_method: bool) -> str:
    args = []
    for m in ARG.finditer(segment):
        default = m.group("default")
        if default is None:
            args.append(m.group("name"))
        else:
            args.append(f'{m.group("name")}={default.strip().replace("::", ".")}')
    if not args and is_method:
        arity = lambda_arity(segment)
        if arity:
            # nanobind names unnamed parameters arg0, arg1...: positional only.
            args = [f"arg{i}" for i in range(arity)]
    return ", ".join(args)


def extract(source: str) -> list[str]:
    out: list[str] = []
    marks = list(BINDING.finditer(source))
    cls = enum = None
    for i, m in enumerate(marks):
        segment = source[m.end() : marks[i + 1].start() if i + 1 < len(marks) else len(source)]
        kind, name = m.group("kind"), m.group("name")
        if m.group("init") is not None:
            # Parameters of a bound C++ constructor are unnamed: positional arg0, arg1...
            types = [t for t in m.group("types").split(",") if t.strip()]
            params = ", ".join(f"arg{i}" for i in range(len(types)))
            out.append(f"method {cls}.__init__({params})")
        elif kind.startswith("nb::class_"):
            cls, enum = name, None
            out.append(f"class {name}")
        elif kind.startswith("nb::enum_"):
            enum, cls = name, None
            out.append(f"enum {name}")
        elif kind == ".value":
            out[-1] += f" {name}"
        elif kind == "m.def":
            out.append(f"function {name}({params_of(segment, False)})")
        elif kind in (".def_ro", ".def_rw", ".def_prop_rw"):
            out.append(f"attribute {cls}.{name}")
        elif kind == ".def_static":
            out.append(f"staticmethod {cls}.{name}({params_of(segment, True)})")
        else:
            assert enum is None, f"method {name} of enum {enum}?"
            out.append(f"method {cls}.{name}({params_of(segment, True)})")
    return out


def main() -> None:
    commit = sys.argv[1] if len(sys.argv) > 1 else "unknown"
    date = sys.argv[2] if len(sys.argv) > 2 else ""
    lines = extract(sys.stdin.read())
    print(f"# UCCL p2p/engine_api.cc at {commit} {date}".rstrip())
    print("# github.com/uccl-project/uccl; written by tests/uccl_api_extract.py (see there)")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
