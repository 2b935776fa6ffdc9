"""The package's shape: no import cycles among memprof's modules (lazy imports included), no module
over 400 lines, no function over 80, and nothing outside `memprof/torch_hooks/` patches torch."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "memprof"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """memprof modules that `name` imports anywhere (a function's lazy import too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m != name}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_modules_and_functions_stay_small() -> None:
    long_modules, long_functions = [], []
    for name, path in _modules().items():
        source = path.read_text()
        if len(source.splitlines()) > 400:
            long_modules.append(f"{name} ({len(source.splitlines())} lines)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 80:
                    long_functions.append(f"{name}.{node.name} ({length} lines)")
    assert not long_modules and not long_functions, (long_modules, long_functions)


_TORCH_NAMES = {"torch", "nx", "networkx", "P", "compile_fx", "inductor_config", "functorch_config", "AotAutograd",
                "GraphLowering", "AsyncCompile", "autograd_profiler", "mp_process", "graph_compile", "inductor_memory",
                "dynamo_config"}


def _base(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def test_only_torch_hooks_patch_torch() -> None:
    """Assignments to attributes of torch, networkx or multiprocessing objects (setattr on them, and
    their config modules' `patch(...)`) happen only in `memprof/torch_hooks/`, through `Patches`
    (the activation memory budget: `torch_hooks.budget`)."""
    offenders = []
    for name, path in _modules().items():
        if name.startswith("memprof.torch_hooks"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr",
                                                                                                     "delattr"):
                targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "patch"
                  and _base(node.func) in _TORCH_NAMES):
                targets = [node.func]
            offenders += [f"{name}:{node.lineno}" for t in targets
                          if isinstance(t, ast.Attribute) and _base(t) in _TORCH_NAMES]
    assert not offenders, offenders
