"""The package's import graph: stages import only downwards, and nothing cycles.

Every import counts, also one placed inside a function: such an import
dodges a cycle at import time but the cycle is still a layering mistake.
Read from the source with ``ast``, so nothing here imports the package.
"""

import ast
import re
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
    "standins",
    "mode",
    "rules",
    "tracing",
    "checkpoint",
    "trust",
    "binding",
    "execution",
    "analysis",
    "timing",
    "pipeline",
    "planning",
    "serving",
    "debug",
    "testing",
    "cli",
    "integrations",
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

    shadowed = [
        name
        for name in metadispatch.__all__
        if f"metadispatch.{name}" in MODULES and name not in ("testing", "checkpoint")
    ]
    assert not shadowed
    # each analysis module's own names are reachable through it
    import metadispatch.analysis.flops as flops_module

    assert callable(flops_module.fmt_count) and callable(metadispatch.flops)


# -- what only some rooms may do (issue 29)


def _chain(node) -> list:
    """``torch.cuda.memory`` -> ["torch", "cuda", "memory"]; [] for anything not rooted in a name."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


_TORCH_NAMES = ("torch", "nn", "F", "dist")  # how the package spells torch's modules
_OPEN_PRIVATE = {"_check"}  # torch's documented argument checker


def _private_torch(node) -> bool:
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr in ("_schema", "_cdata"):
        return True
    if _private_of_compat(node):
        return True
    chain = _chain(node)
    if not chain or chain[0] not in _TORCH_NAMES or chain[1:2] == ["ops"] or node.attr != chain[-1]:
        return False  # ops' own names (``torch.ops.aten._to_copy``) are public
    return any(a.startswith("_") and not a.startswith("__") and a not in _OPEN_PRIVATE for a in chain[1:])


def _private_of_compat(node: ast.Attribute) -> bool:
    """``_compat.context_parallel_module()._cp_options``: a private name of the torch module or
    class that a ``_compat`` function hands out is read where ``_compat`` should read it."""
    value = node.value
    return (
        isinstance(value, ast.Call)
        and _chain(value.func)[:1] == ["_compat"]
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layering_private_torch_attributes_only_in_compat_and_spec(module):
    """``._schema``, ``._cdata`` and ``torch._X`` are read in ``_compat/``
    (one module per torch subsystem) and ``spec/`` (op facts) only, so a
    torch upgrade touches those two rooms."""
    if _room(module) in ("_compat", "spec"):
        return
    tree = ast.parse(MODULES[module].read_text())
    found = [f"{ast.unparse(n)} (line {n.lineno})" for n in ast.walk(tree) if _private_torch(n)]
    found += [f"import {name} (line {n.lineno})" for n in ast.walk(tree) for name in _private_torch_imports(n)]
    assert not found, f"{module} reads private torch attributes: {found}"


def _private_torch_imports(node) -> list:
    """``from torch._dynamo import x``, ``import torch.utils._pytree``, ``from torch import _C``:
    every private module, also those ruff's banned list (pyproject.toml) does not name."""
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        return []
    private = [
        n
        for n in names
        if n.split(".")[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in n.split(".")[1:])
    ]
    return private[:1]  # the module once, not each name imported from it


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layering_no_patch_outside_the_ledger(module):
    """Note [The ledger]: an attribute of torch's is replaced by the ledger
    only (``mode/ledger.py``), from the rows each room lists; ``_compat/``
    sets the few flags torch's own modes set."""
    if module == "metadispatch.mode.ledger" or _room(module) == "_compat":
        return
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = node.args[:1]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        else:
            continue
        for t in targets:
            if not isinstance(node, ast.Call) and not isinstance(t, ast.Attribute):
                continue  # a name of the module's own
            chain = _chain(t)
            if chain and (chain[0] in _TORCH_NAMES or chain[0] == "_compat"):
                found.append(f"{ast.unparse(t)} (line {node.lineno})")
    assert not found, f"{module} changes torch outside the ledger: {found}"


# Module-level state that changes at run time, with why it is module-level.
# A new entry needs its reason; state that can live on an object should.
_STATE = {
    ("metadispatch._compat.process", "_HOST_CUDA"): "whether the host has CUDA, asked of C++ once",
    ("metadispatch.analysis.flops", "_USER"): "md.register_flops' table, process-wide as torch's formulas are",
    ("metadispatch.core.cache", "_CONTEXTS"): "the shared context tuples (Note [What an entry weighs])",
    ("metadispatch.core.cache", "_SHARED"): "the metadata cache every mode shares (Note [What the key must hold])",
    ("metadispatch.core.cache", "_TOTAL"): "the shared cache's bytes",
    ("metadispatch.core.dispatch", "_FAST"): "whether each op may take the cache-hit path, decided once",
    ("metadispatch.core.registry", "_USER"): "md.register_meta's rules, process-wide as torch's dispatcher is",
    ("metadispatch.core.registry", "_version"): "the registry's version, in every cache key",
    ("metadispatch.core.rngstate", "_TORCH"): "torch's RNG functions below the ledger's patches",
    ("metadispatch.core.router", "_NO_NATIVE"): "ops whose meta kernel turned out missing: asked once",
    ("metadispatch.execution.bindings", "_PROVEN"): "Python bindings proven the same as their op, once each",
    ("metadispatch.trust.costs", "_COSTS"): "a trace's costs, weakly keyed by the trace",
    ("metadispatch.trust.costs", "_FIXED"): "a trace's fixed costs, weakly keyed by the trace",
    ("metadispatch.binding.devices", "_KEEPS"): "a trace's CPU tensors, weakly keyed by the trace",
    (
        "metadispatch._compat.autograd",
        "OUTSIDE_THE_ENGINE",
    ): "a thread's backward run outside the engine (thread-local)",
    (
        "metadispatch.rules.pinned",
        "_PINNED",
    ): "storages pinned while tracing, weakly held (Note [Pinned memory on a logical host])",
    (
        "metadispatch.trust.index_checks",
        "CHECKS",
    ): "the pre-call checks of a loaded trace, by op, filled by registration",
    (
        "metadispatch.trust.shape_checks",
        "_WORKSPACES",
    ): "oneDNN LSTM workspace sizes, measured once per input shape",
    ("metadispatch.binding.inputs", "_PLAIN"): "module classes that name their tensors as nn.Module does",
    ("metadispatch.execution.program", "_PROGRAMS"): "a trace's compiled program, weakly keyed by the trace",
    ("metadispatch.execution.uninit", "_FOUND"): "a trace's uninitialised reads, weakly keyed by the trace",
    ("metadispatch.binding.writes", "_WRITTEN"): "a trace's written leaves, weakly keyed by the trace",
    ("metadispatch.gpu.cuda_answers", "_ANSWERING"): "the modes answering as a logical GPU, in any thread",
    ("metadispatch.gpu.fastpath", "_TORCH"): "torch's has_torch_function below the ledger's patch",
    ("metadispatch.gpu.inside", "_GLOBALS"): "torch functions' globals with the overrides off, made once",
    ("metadispatch.gpu.inside", "_REBOUND"): "torch functions rebound to those globals, made once",
    ("metadispatch.gpu.logical_cuda", "_PROFILE"): "the GPU a thread's logical world answers as (thread-local)",
    ("metadispatch.ir.decode", "_registered"): "the dispatcher's op names, read again when an op is new",
    ("metadispatch.ir.serialize", "_DTYPE_NAMES"): "dtype names, read once from torch",
    ("metadispatch.mode.ledger", "_DECLARED"): "the ledger's patches by group (Note [The ledger])",
    ("metadispatch.mode.ledger", "_ORDER"): "the ledger's patches in answering order",
    ("metadispatch.mode.ledger", "_RANK"): "each patch's place in the answering order",
    ("metadispatch.mode.ledger", "_SLOTS"): "what the ledger installed, process-wide as torch's attributes are",
    ("metadispatch.mode.ledger", "_USERS"): "claims per group, in every thread",
    ("metadispatch.mode.mode", "_SCRATCH"): "a thread's non-recording mode for rules outside a mode (thread-local)",
    ("metadispatch.standins.standins", "_ACTIVE"): "a thread's stand-ins (thread-local)",
    ("metadispatch.mode.unseen", "_TORCH"): "torch's functions below the ledger's patches",
    ("metadispatch.mode.realcode", "_TORCH"): "torch's DataLoader methods below the ledger's patches",
    ("metadispatch.rules.cudnn_branch", "_DROPOUT_STATES"): "cuDNN's dropout state per module, weakly keyed",
    ("metadispatch.spec.ownops", "_LIBRARY"): "our own ops' library, defined once when first needed",
    ("metadispatch.spec.profiles", "_PROFILES"): "md.register_gpu's profiles",
    ("metadispatch.spec.schema", "_CACHE"): "each op's facts, computed once (Note in spec/schema.py)",
    ("metadispatch.tensor.tensor", "STATE"): "a thread's dispatch state (thread-local)",
    ("metadispatch.tensor.tensor", "_READS"): "a thread's count of value reads (thread-local)",
    ("metadispatch.values.composites", "BY_FUNCTION"): "composite overrides by torch function, filled by registration",
    ("metadispatch.values.known", "_MUTATED"): "ops that write their arguments, computed once each",
    ("metadispatch.world.world", "_CURRENT"): "a thread's logical world (thread-local)",
    ("metadispatch.world.world", "_LIVE"): "the logical world entered, one per process",
    ("metadispatch.world.pipeline", "_GRADIENT_MESSAGES"): "a stage's gradient messages, held weakly until issued",
}
_MUTATORS = {
    "append",
    "add",
    "update",
    "pop",
    "clear",
    "setdefault",
    "extend",
    "remove",
    "discard",
    "insert",
    "popitem",
}


def _mutated_module_state(path: Path) -> set:
    """Module-level names a function of the module changes: ``global`` ones,
    ones written through ``[...] =`` or ``.attr =``, and ones a mutating
    method (``append``, ``update``, ...) is called on."""
    tree = ast.parse(path.read_text())
    top = set()
    for n in tree.body:
        if isinstance(n, ast.Assign):
            top |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            top.add(n.target.id)
    found = set()
    for f in ast.walk(tree):
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(f):
            if isinstance(node, ast.Global):
                found |= set(node.names) & top
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
                if isinstance(node.func.value, ast.Name) and node.func.value.id in top:
                    found.add(node.func.value.id)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                        if t.value.id in top:
                            found.add(t.value.id)
    return found


def test_layering_module_level_state_is_allow_listed():
    found = {(m, name) for m, p in MODULES.items() for name in _mutated_module_state(p)}
    assert not found - _STATE.keys(), f"module-level state without a reason in _STATE: {sorted(found - _STATE.keys())}"
    assert not _STATE.keys() - found, f"_STATE names state no module keeps: {sorted(_STATE.keys() - found)}"


@pytest.mark.parametrize(
    "package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and m != "metadispatch")
)
def test_layering_every_subpackage_docstring_names_its_modules(package):
    path = MODULES[package]
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    modules = [p.stem for p in path.parent.glob("*.py") if p.stem != "__init__"]
    missing = [m for m in modules if not re.search(rf"\b{re.escape(m)}\b", doc)]
    assert not missing, f"{package}'s docstring does not name {missing}"


_ROOT = PACKAGE.parent
_NOTE_FILES = sorted(
    [*PACKAGE.rglob("*.py"), *(_ROOT / "tests").glob("*.py"), *(_ROOT / "tools").glob("*.py")]
    + [*(_ROOT / "benchmarks").glob("*.py"), *(_ROOT / "docs").glob("*.md")]
    + [_ROOT / "README.md", _ROOT / "CONTRIBUTING.md", _ROOT / "metadispatch_pytest.py"]
)
# A Note is defined by its title alone on a line, underlined with tildes.
_NOTE_DEF = re.compile(r"^[ \t]*(?:#[ \t]*)?(?:[rbu]?\"\"\")?Note \[([^\]\n]+)\][ \t]*\n[ \t]*(?:#[ \t]*)?~{3,}", re.M)
_NOTE_REF = re.compile(r"Note\s*(?:#\s*)?\[([^\]]+)\]")


def _title(raw: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"\n\s*#", " ", raw)).strip()


def test_layering_every_cited_note_is_defined_once():
    defined: dict = {}
    cited: dict = {}
    for path in _NOTE_FILES:
        text = path.read_text()
        for m in _NOTE_DEF.finditer(text):
            defined.setdefault(_title(m[1]), []).append(str(path.relative_to(_ROOT)))
        for m in _NOTE_REF.finditer(text):
            cited.setdefault(_title(m[1]), set()).add(str(path.relative_to(_ROOT)))
    twice = {k: v for k, v in defined.items() if len(v) > 1}
    undefined = {k: sorted(v) for k, v in cited.items() if k not in defined}
    assert not twice, f"Notes defined more than once: {twice}"
    assert not undefined, f"Notes cited but never defined: {undefined}"


# Modules over _LONG lines, each with the Note (defined in it) that says why
# it is one piece.  A module that grows past _LONG is split along its
# concepts, or gets such a Note and a line here.
_LONG = 450
_ONE_PIECE = {
    "metadispatch.ir.reader": "One reader per file",
    "metadispatch.tensor.tensor": "MetaTensor in one module",
}


def test_layering_a_long_module_has_a_note_saying_why_it_is_one_piece():
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    long = {m: n for m, n in long.items() if n > _LONG}
    unexplained = sorted(set(long) - _ONE_PIECE.keys())
    assert not unexplained, f"modules over {_LONG} lines with no Note on why they are one piece: {unexplained}"
    for module, title in _ONE_PIECE.items():
        assert module in long, f"{module} is no longer over {_LONG} lines: take it out of _ONE_PIECE"
        notes = {_title(m[1]) for m in _NOTE_DEF.finditer(MODULES[module].read_text())}
        assert title in notes, f"{module} does not define the Note titled {title!r}"


# A room (a subpackage) stays under ~2.5k lines: past it, one of its
# concerns has grown into a room of its own, or belongs in another.
_ROOM_LINES = 2500
_ROOMS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


@pytest.mark.parametrize("room", _ROOMS)
def test_layering_no_room_is_over_2500_lines(room):
    lines = sum(len(p.read_text().splitlines()) for p in (PACKAGE / room).rglob("*.py"))
    assert lines <= _ROOM_LINES, (
        f"metadispatch/{room}/ is {lines} lines: move a concern to its own room or the right one"
    )


# Rooms whose tests are the other rooms' tests, with why.
_UNTESTED_ROOMS = {"_compat": "every room's tests run through it; a torch upgrade's breakage shows there"}


def test_layering_tests_mirror_the_rooms():
    # tests/<room>/ holds the tests of metadispatch/<room>/, so a module's test is found by its path
    folders = {p.name for p in (_ROOT / "tests").iterdir() if p.is_dir() and p.name[0] not in "._"}
    assert not folders - set(_ROOMS), f"test folders that name no room: {sorted(folders - set(_ROOMS))}"
    missing = set(_ROOMS) - folders - _UNTESTED_ROOMS.keys()
    assert not missing, f"rooms without a tests/<room>/ folder: {sorted(missing)}"
    assert not _UNTESTED_ROOMS.keys() & folders, "a room in _UNTESTED_ROOMS has tests now: take it out"


def test_layering_test_files_have_unique_names():
    # tests/ has no __init__.py files (rootdir imports), so two test files of one name
    # in different rooms fail collection of the second ("import file mismatch").
    names: dict = {}
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}
