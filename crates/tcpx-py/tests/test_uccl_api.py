"""tcpx.p2p against UCCL's exported API: every name in tests/uccl_api.txt (taken from UCCL's
p2p/engine_api.cc at the commit named in its header) exists in our stub file p2p.pyi with
compatible parameters (same names in the same order, UCCL's defaults, anything extra
optional), and the stub matches the native module (so neither can drift)."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

import tcpx
from tcpx import p2p

HERE = Path(__file__).parent
STUB = Path(tcpx.__file__).parent / "p2p.pyi"
LIST = HERE / "uccl_api.txt"

Param = Tuple[str, Optional[str]]  # (name, default source or None)


# -- the stub, parsed ------------------------------------------------------------------


@dataclass
class Fn:
    positional: List[Param]
    varargs: bool
    kwonly: List[Param]
    varkw: bool
    static: bool = False
    is_property: bool = False

    def names(self) -> List[str]:
        return [n for n, _ in self.positional] + [n for n, _ in self.kwonly]


@dataclass
class Cls:
    methods: Dict[str, Fn] = field(default_factory=dict)
    attributes: set = field(default_factory=set)


def _fn(node: ast.FunctionDef) -> Fn:
    a = node.args
    decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    pos = a.posonlyargs + a.args
    if "staticmethod" not in decorators and pos and pos[0].arg == "self":
        pos = pos[1:]
    defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    kwdefaults = [None if d is None else ast.unparse(d) for d in a.kw_defaults]
    return Fn(
        positional=[(p.arg, d) for p, d in zip(pos, defaults)],
        varargs=a.vararg is not None,
        kwonly=[(p.arg, d) for p, d in zip(a.kwonlyargs, kwdefaults)],
        varkw=a.kwarg is not None,
        static="staticmethod" in decorators,
        is_property="property" in decorators,
    )


def parse_stub() -> Tuple[Dict[str, Fn], Dict[str, Cls], set]:
    tree = ast.parse(STUB.read_text())
    functions: Dict[str, Fn] = {}
    classes: Dict[str, Cls] = {}
    values: set = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = _fn(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            values.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            c = Cls()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    f = _fn(item)
                    if f.is_property:
                        c.attributes.add(item.name)
                    else:
                        c.methods[item.name] = f
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    c.attributes.add(item.target.id)
            classes[node.name] = c
    return functions, classes, values


# -- UCCL's list, parsed ----------------------------------------------------------------


def _params(text: str) -> List[Param]:
    out: List[Param] = []
    for p in filter(None, (s.strip() for s in text.split(","))):
        name, eq, default = p.partition("=")
        out.append((name.strip(), default.strip() if eq else None))
    return out


def uccl_entries() -> List[Tuple[str, str, Optional[List[Param]], List[str]]]:
    """(kind, qualified name, params or None, enum members) per line."""
    entries = []
    for line in LIST.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        kind, _, rest = line.partition(" ")
        if kind == "enum":
            name, *members = rest.split()
            entries.append((kind, name, None, members))
        elif "(" in rest:
            name, _, params = rest.partition("(")
            entries.append((kind, name, _params(params.rstrip(")")), []))
        else:
            entries.append((kind, rest.strip(), None, []))
    return entries


def incompatibility(uccl: List[Param], ours: Fn) -> Optional[str]:
    """Why a call written for UCCL's signature would not bind the same way to ours."""
    names = [n for n, _ in uccl]
    if not ours.varargs:
        got = [n for n, _ in ours.positional[: len(names)]]
        if got != names:
            return f"positional parameters {got} where UCCL has {names}"
    accepted = dict(ours.positional + ours.kwonly)
    for name, default in uccl:
        if name not in accepted and not ours.varkw:
            return f"no parameter {name!r}"
        if default is not None and accepted.get(name) != default:
            return f"{name}: default {accepted.get(name)!r} where UCCL has {default!r}"
    for name, default in ours.positional + ours.kwonly:
        if name not in names and default is None:
            return f"extra parameter {name!r} without a default"
    return None


def test_the_list_names_its_upstream_commit():
    header = LIST.read_text().splitlines()[0]
    commit = header.split(" at ")[1].split()[0]
    assert len(commit) == 40 and int(commit, 16) >= 0, header


def test_every_uccl_export_exists_with_a_compatible_signature():
    functions, classes, values = parse_stub()
    problems = []
    for kind, qual, params, members in uccl_entries():
        if kind == "function":
            if qual not in functions:
                problems.append(f"function {qual} missing")
            elif (why := incompatibility(params, functions[qual])) is not None:
                problems.append(f"{qual}: {why}")
        elif kind == "class":
            if qual not in classes:
                problems.append(f"class {qual} missing")
        elif kind == "enum":
            if qual not in classes:
                problems.append(f"enum {qual} missing")
                continue
            for m in members:
                if m not in classes[qual].attributes:
                    problems.append(f"{qual}.{m} missing")
                if m not in values:
                    problems.append(f"module-level {m} missing (UCCL exports enum values)")
        else:
            cls, _, name = qual.partition(".")
            c = classes.get(cls)
            if c is None:
                problems.append(f"{qual}: class {cls} missing")
            elif kind == "attribute":
                if name not in c.attributes:
                    problems.append(f"attribute {qual} missing")
            elif name == "__repr__":
                if not callable(getattr(getattr(p2p, cls), "__repr__", None)):
                    problems.append(f"{qual} missing")
            elif name not in c.methods:
                problems.append(f"{kind} {qual} missing")
            else:
                f = c.methods[name]
                if (kind == "staticmethod") != f.static:
                    problems.append(f"{qual}: static in one, not in the other")
                if (why := incompatibility(params, f)) is not None:
                    problems.append(f"{qual}: {why}")
    assert not problems, "\n".join(problems)


def _native_fn(obj, name) -> inspect.Signature:
    target = obj if name == "__init__" else getattr(obj, name)
    return inspect.signature(target)


def test_the_stub_matches_the_native_module():
    functions, classes, values = parse_stub()
    problems = []
    for name in values:
        if not hasattr(p2p, name):
            problems.append(f"p2p.{name} missing")
    for name, f in functions.items():
        if not hasattr(p2p, name):
            problems.append(f"p2p.{name}() missing")
        else:
            problems += _compare(name, f, inspect.signature(getattr(p2p, name)), False)
    for cname, c in classes.items():
        native = getattr(p2p, cname, None)
        if native is None:
            problems.append(f"p2p.{cname} missing")
            continue
        public = {n for n in dir(native) if not n.startswith("_")}
        described = set(c.methods) | c.attributes
        for extra in sorted(public - described):
            problems.append(f"{cname}.{extra} exists but the stub does not describe it")
        for attr in c.attributes:
            if not hasattr(native, attr):
                problems.append(f"{cname}.{attr} missing")
        for mname, f in c.methods.items():
            if mname != "__init__" and not hasattr(native, mname):
                problems.append(f"{cname}.{mname} missing")
                continue
            if mname.startswith("__") and mname != "__init__":
                continue  # slot wrappers carry no signature
            problems += _compare(f"{cname}.{mname}", f, _native_fn(native, mname), not f.static)
    assert not problems, "\n".join(problems)


def _compare(name: str, f: Fn, sig: inspect.Signature, method: bool) -> List[str]:
    params = list(sig.parameters.values())
    if method and params and params[0].name == "self":
        params = params[1:]
    P = inspect.Parameter
    native_pos = [(p.name, p.default is not P.empty) for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    native_kw = [(p.name, p.default is not P.empty) for p in params if p.kind == P.KEYWORD_ONLY]
    stub_pos = [(n, d is not None) for n, d in f.positional]
    stub_kw = [(n, d is not None) for n, d in f.kwonly]
    out = []
    if native_pos != stub_pos or native_kw != stub_kw:
        out.append(f"{name}: native {sig} vs stub {stub_pos} kw {stub_kw}")
    if any(p.kind == P.VAR_POSITIONAL for p in params) != f.varargs:
        out.append(f"{name}: *args differs")
    return out


def test_the_extractor_reads_nanobind_bindings():
    sys.path.insert(0, str(HERE))
    from uccl_api_extract import extract

    src = '''
    m.def("get_oob_ip", &uccl::get_oob_ip, "doc");
    nb::class_<XferDesc>(m, "XferDesc")
        .def(nb::init<>())
        .def_rw("size", &XferDesc::size);
    nb::enum_<FloatType>(m, "FloatType")
        .value("kA", FloatType::kA)
        .value("kB", FloatType::kB)
        .export_values();
    nb::class_<Endpoint>(m, "Endpoint")
        .def("reg", [](Endpoint& self, uint64_t ptr, size_t size, FloatType t) { return f(g(1, 2)); },
             "doc", nb::arg("ptr"), nb::arg("size"), nb::arg("floatType") = FloatType::kA)
        .def("accept", [](Endpoint& self) { return nb::make_tuple(1, 2); })
        .def_static("parse", [](nb::bytes b) { return 0; }, nb::arg("metadata"));
    '''
    assert extract(src) == [
        "function get_oob_ip()",
        "class XferDesc",
        "method XferDesc.__init__()",
        "attribute XferDesc.size",
        "enum FloatType kA kB",
        "class Endpoint",
        "method Endpoint.reg(ptr, size, floatType=FloatType.kA)",
        "method Endpoint.accept()",
        "staticmethod Endpoint.parse(metadata)",
    ]


def test_the_list_is_what_the_extractor_gives_for_its_commit():
    """Where a UCCL checkout is at hand (UCCL_REPO, a git directory), the checked-in list is
    exactly the extractor's output for the commit it names."""
    repo = os.environ.get("UCCL_REPO")
    if not repo:
        pytest.skip("set UCCL_REPO to a uccl-project/uccl git directory to regenerate the list")
    header = LIST.read_text().splitlines()[0]
    commit, date = header.split(" at ")[1].split()[:2]
    source = subprocess.run(
        ["git", "-C", repo, "show", f"{commit}:p2p/engine_api.cc"], capture_output=True, check=True
    ).stdout
    out = subprocess.run(
        [sys.executable, str(HERE / "uccl_api_extract.py"), commit, date],
        input=source,
        capture_output=True,
        check=True,
    ).stdout.decode()
    assert out == LIST.read_text()
