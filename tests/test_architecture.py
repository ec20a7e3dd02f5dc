"""The import rules of docs/architecture.md, read from every file of mxtrain/ with ``ast``.

Every import counts, including those inside functions. ``from pkg import name`` is followed
through ``pkg/__init__.py`` re-exports to the file that defines ``name``, so importing a
package's public name is an edge to the file that holds it, not to the package facade.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mxtrain"

# Layers, lowest first: a file may import its own layer or any layer below it, never one above.
LAYERS = [
    ("mxtrain.config", "mxtrain.formats", "mxtrain.oplib"),
    ("mxtrain.quantization",),
    ("mxtrain.emulation", "mxtrain.activations"),  # elementwise-precision emulation; activation math in torch ops (under elementwise/, the norm modules and compat/mx)
    ("mxtrain.kernels",),
    ("mxtrain.recipes", "mxtrain.autocast"),
    ("mxtrain.modules", "mxtrain.elementwise"),
    ("mxtrain.distributed", "mxtrain.convert", "mxtrain.integrations", "mxtrain.graphs", "mxtrain.data"),
    ("mxtrain", "mxtrain.cli"),  # the package facade (mxtrain/__init__.py) and the command line
    ("mxtrain.compat",),  # microxcaling's API on top: nothing outside it imports it
]

# Known violations, (importer, imported) modules: to remove (issue 24). A new violation fails the test,
# and a fixed one must leave this list.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_CYCLES: list[set[str]] = []


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(FILES[module].read_text(), filename=str(FILES[module]))


def _package_of(module: str) -> str:
    return module if FILES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module)
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _existing(name: str) -> str:
    while name not in FILES:
        name = name.rsplit(".", 1)[0]
    return name


def _defining_file(module: str, name: str, seen: frozenset = frozenset()) -> str:
    """The file ``from module import name`` reaches: a submodule, or where a package re-exports it from."""
    if f"{module}.{name}" in FILES:
        return f"{module}.{name}"
    if module not in FILES or FILES[module].name != "__init__.py" or module in seen:
        return _existing(module)
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.startswith("mxtrain") and source != module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return _defining_file(source, alias.name, seen | {module})
    return module


@functools.cache
def imports(module: str) -> dict[str, int]:
    """The mxtrain files ``module`` imports (anywhere in it), each with the first line that does."""
    found: dict[str, int] = {}
    for node in ast.walk(_tree(module)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [_existing(a.name) for a in node.names if a.name.split(".")[0] == "mxtrain"]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] == "mxtrain":
                targets = [_defining_file(source, a.name) if source in FILES else _existing(source)
                           for a in node.names]
        for target in targets:
            if target != module:
                found.setdefault(target, node.lineno)
    return found


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return rank


def upward_imports() -> set[tuple[str, str]]:
    return {(m, t) for m in FILES for t in imports(m) if layer_of(t) > layer_of(m)}


def cycles() -> list[set[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in imports(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(FILES):
        if module not in index:
            visit(module)
    return found


def _describe(pairs) -> str:
    return "\n".join(f"  {m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)}) at line {imports(m)[t]}"
                     for m, t in sorted(pairs))


def test_every_file_has_a_layer():
    for module in FILES:
        layer_of(module)


def test_imports_point_down_the_layers():
    new = upward_imports() - ALLOWED_UPWARD
    assert not new, "imports pointing up the layers (docs/architecture.md):\n" + _describe(new)


def test_no_import_cycles_between_files():
    new = [c for c in cycles() if not any(c <= allowed for allowed in ALLOWED_CYCLES)]
    assert not new, "import cycles between files: " + "; ".join(" <-> ".join(sorted(c)) for c in new)


def test_allowed_lists_hold_only_live_violations():
    """An entry fixed since must leave the ALLOWED lists, so they only shrink."""
    assert ALLOWED_UPWARD <= upward_imports(), sorted(ALLOWED_UPWARD - upward_imports())
    found = cycles()
    assert all(any(c & allowed for c in found) for allowed in ALLOWED_CYCLES)


def test_the_checker_sees_imports_inside_functions():
    assert "mxtrain.kernels.cast" in imports("mxtrain.kernels.cuda_cast")  # imported only inside functions
    assert layer_of("mxtrain.compat.mx.specs") > layer_of("mxtrain.modules.linear") > layer_of("mxtrain.formats")


def test_fsdp_hooks_ask_tensors_and_modules_not_reach_into_them():
    """Issue 24: the FSDP2 all-gather hooks ask the quantized tensor, the recipe or the module (through its
    class's public attributes) for what they need; they import nothing from mxtrain.modules and do no
    arithmetic on buffer addresses (``data_ptr()``)."""
    fsdp = "mxtrain.distributed.fsdp"
    into_modules = sorted(t for t in imports(fsdp) if t == "mxtrain.modules" or t.startswith("mxtrain.modules."))
    assert not into_modules, f"{fsdp} imports {into_modules}"
    calls = [node.lineno for node in ast.walk(_tree(fsdp)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "data_ptr"]
    assert not calls, f"{fsdp} takes buffer addresses (data_ptr()) at lines {calls}"
