"""The package's import structure, read from the source with `ast` (nothing is imported).

Every import counts: module level, inside functions (lazy), inside try/if blocks, and
`importlib.import_module("npu_flashrl...")` with a literal name. An import of `a.b` from module
`m` is an edge m -> a.b (`from a import b` is m -> a.b when a/b is a module, else m -> a).

* 0 import cycles between the package's modules (a failure prints each cycle as a path with
  file:line of every edge).
* The simulation fence: runtime code never reaches `npu_flashrl.sim` (the CPU simulation) nor
  `npu_flashrl.rehearsal` (built on it), directly or through another module. Runtime code is every
  module except these two packages and `npu_flashrl.cli`, which hosts the `rehearse` subcommand
  (it imports the rehearsal only to register it). So a new module is fenced by default.
* `npu_flashrl.errors` imports nothing from the package (anything may import it), and every
  exception class of the package derives from its `NpuFlashrlError`.
"""
import ast
import builtins
import os
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PKG = "npu_flashrl"
SIM = ("npu_flashrl.sim", "npu_flashrl.rehearsal")
NOT_RUNTIME = SIM + ("npu_flashrl.cli",)

pytestmark = pytest.mark.every_line

Edge = Tuple[str, str, int]  # (target module, file, line)


def _modules() -> Dict[str, str]:
    """{dotted module name: path} for every .py file of the package."""
    out = {}
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, PKG)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, "").endswith("__init__.py")


def _resolve(name: str) -> Optional[str]:
    """The package module `name` (or its nearest existing parent), None outside the package."""
    if name != PKG and not name.startswith(PKG + "."):
        return None
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str, path: str) -> List[Edge]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    rel = os.path.relpath(path, ROOT)
    base_parts = module.split(".") if _is_package(module) else module.split(".")[:-1]
    edges: List[Edge] = []
    for node in ast.walk(tree):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base_parts[:len(base_parts) - (node.level - 1)]
                src = ".".join(parts + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                targets.append(sub if sub in MODULES else src)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for t in targets:
            r = _resolve(t)
            if r is not None and r != module:
                edges.append((r, rel, node.lineno))
    return edges


GRAPH: Dict[str, List[Edge]] = {m: _edges(m, p) for m, p in MODULES.items()}


def _sccs() -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    counter = [0]
    for start in sorted(GRAPH):
        if start in index:
            continue
        work = [(start, iter(sorted({e[0] for e in GRAPH[start]})))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted({e[0] for e in GRAPH[w]}))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _path(src: str, goal, allowed=None) -> Optional[List[Edge]]:
    """Shortest import path (edges) from `src` to a module for which `goal(m)` holds (BFS)."""
    prev: Dict[str, Tuple[str, Edge]] = {}
    frontier, seen = [src], {src}
    while frontier:
        nxt = []
        for m in frontier:
            for e in sorted(GRAPH[m]):
                t = e[0]
                if allowed is not None and t not in allowed:
                    continue
                if goal(t):
                    chain = [e]
                    while m != src:
                        m, edge = prev[m]
                        chain.append(edge)
                    return chain[::-1]
                if t not in seen:
                    seen.add(t)
                    prev[t] = (m, e)
                    nxt.append(t)
        frontier = nxt
    return None


def _show(src: str, chain: List[Edge]) -> str:
    return src + "".join(f"\n    -> {t}  ({f}:{ln})" for t, f, ln in chain)


def test_the_walk_sees_the_package():
    """The walker finds known edges, a lazy one included (guards against a walker that sees nothing)."""
    assert len(MODULES) > 60
    targets = {m: {e[0] for e in es} for m, es in GRAPH.items()}
    assert "npu_flashrl.patches" in targets["npu_flashrl.config"] or "npu_flashrl._logging" in targets[
        "npu_flashrl.config"]
    assert "npu_flashrl.activation" in targets["npu_flashrl"]  # a lazy import, inside activate()
    assert "npu_flashrl.rehearsal" in targets["npu_flashrl.cli"]  # importlib.import_module("...")


def test_no_import_cycles():
    cycles = []
    for comp in _sccs():
        members = set(comp)
        start = comp[0]
        chain = _path(start, lambda m: m == start, allowed=members)
        cycles.append(_show(start, chain) if chain else " <-> ".join(comp))
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s):\n" + "\n".join(cycles), pytrace=False)


def _in(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_runtime_code_never_imports_the_simulation():
    runtime = sorted(m for m in MODULES if not _in(m, NOT_RUNTIME))
    assert {"npu_flashrl.adapters.vllm_ascend.reload", "npu_flashrl.quant", "npu_flashrl.kernels",
            "npu_flashrl.config", "npu_flashrl.activation", "npu_flashrl.plugin", "npu_flashrl.patches",
            "npu_flashrl.verify", "npu_flashrl"} <= set(runtime)
    breaches = []
    for m in runtime:
        chain = _path(m, lambda t: _in(t, SIM))
        if chain:
            breaches.append(_show(m, chain))
    if breaches:
        pytest.fail("runtime code reaches the simulation:\n" + "\n".join(breaches), pytrace=False)


def test_errors_module_imports_nothing_from_the_package():
    assert GRAPH["npu_flashrl.errors"] == []


def _exception_classes():
    """{class name: (module, line, [base names])} for every class of the package."""
    out = {}
    for m, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                out.setdefault(node.name, []).append((m, node.lineno, bases))
    return out


def test_every_exception_derives_from_npu_flashrl_error():
    classes = _exception_classes()
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}

    def ancestry(name, seen=()):
        if name in seen:
            return set()
        found = {name}
        for _, _, bases in classes.get(name, []):
            for b in bases:
                found |= ancestry(b, seen + (name,))
        return found

    exceptions = {n: defs for n, defs in classes.items()
                  if any(b in builtin for b in ancestry(n) if b not in classes)}
    missing = [f"{m}:{ln} class {n}({', '.join(bases)})" for n, defs in sorted(exceptions.items())
               for m, ln, bases in defs if "NpuFlashrlError" not in ancestry(n) and n != "NpuFlashrlError"]
    assert len(exceptions) >= 15
    if missing:
        pytest.fail("not derived from NpuFlashrlError:\n" + "\n".join(missing), pytrace=False)
