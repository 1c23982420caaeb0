"""The package's import graph: stages import only downwards, and nothing cycles.

Every import counts, also one placed inside a function: such an import
dodges a cycle at import time but the cycle is still a layering mistake.
Read from the source with ``ast``, so nothing here imports the package.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "metadispatch"

# Low to high.  A module may import its own stage or a lower one.
STAGES = [
    "_compat",
    "errors",
    "source",
    "spec",
    "ir",
    "tensor",
    "values",
    "gpu",
    "world",
    "core",
    "mode",
    "rules",
    "tracing",
    "execution",
    "analysis",
    "debug",
    "testing",
    "cli",
    "__init__",
    "__main__",
]


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _stage(module: str) -> int:
    parts = module.split(".")
    return STAGES.index(parts[1] if len(parts) > 1 else "__init__")


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import of the package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:  # annotations only: never imported at run time
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("metadispatch"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in MODULES else (target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("metadispatch.")]
    return found


GRAPH = {m: sorted({t for t, _, _ in _imports(m) if t in MODULES and t != m}) for m in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layering_imports_point_down_the_stages(module):
    upward = [
        f"{target} (line {line})"
        for target, _, line in _imports(module)
        if target in MODULES and _stage(target) > _stage(module)
    ]
    assert not upward, f"{module} imports a higher stage: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layering_no_private_names_of_other_modules(module):
    private = [
        f"{target}.{name} (line {line})"
        for target, name, line in _imports(module)
        if name.startswith("_") and target != module
    ]
    assert not private, f"{module} imports private names: {private}"


def test_layering_import_graph_has_no_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m, path):
        state[m] = 1
        for t in GRAPH[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_layering_every_module_is_in_a_stage():
    assert all(_stage(m) >= 0 for m in MODULES)


def test_layering_no_public_name_shadows_a_module():
    import metadispatch

    shadowed = [name for name in metadispatch.__all__ if f"metadispatch.{name}" in MODULES and name != "testing"]
    assert not shadowed
    # each analysis module's own names are reachable through it
    import metadispatch.analysis.flops as flops_module

    assert callable(flops_module.fmt_count) and callable(metadispatch.flops)
