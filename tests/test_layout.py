"""The package's layering, read from its source: no import cycle, no private names across modules.

Each module of ``src/dilated_attention`` may import lower modules and use
their public names only; a name starting with "_" stays in its module. The
test parses every file (imports inside functions count too), so the rule
holds as the code changes.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = "dilated_attention"
ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path) -> Tuple[Set[str], List[str], Dict[str, str]]:
    """(internal modules imported, private names imported, alias -> internal module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    deps: Set[str] = set()
    private: List[str] = []
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    deps.add(a.name)
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node)
            if source.split(".")[0] != PACKAGE:
                continue
            for a in node.names:
                target = f"{source}.{a.name}"
                if target in MODULES:  # `from . import comm`: a module
                    deps.add(target)
                    aliases[a.asname or a.name] = target
                else:
                    deps.add(source)
                    if a.name.startswith("_"):
                        private.append(f"{module} imports {a.name} from {source}")
    return deps, private, aliases


def _private_attributes(path: Path, aliases: Dict[str, str], module: str) -> List[str]:
    """`comm._name`-style uses of another module's private names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{module} uses {aliases[node.value.id]}.{node.attr}")
    return found


def _graph() -> Tuple[Dict[str, Set[str]], List[str]]:
    graph: Dict[str, Set[str]] = {}
    problems: List[str] = []
    for module, path in MODULES.items():
        deps, private, aliases = _imports(module, path)
        # importing a subpackage's module implies its package __init__; only edges between
        # files count, and a package's own __init__ re-exporting is not a dependency back
        graph[module] = {d for d in deps if d in MODULES and d != module}
        problems += private + _private_attributes(path, aliases, module)
    return graph, problems


def test_no_module_imports_a_private_name_of_another() -> None:
    _, problems = _graph()
    assert not problems, "\n".join(problems)


def test_no_private_modules() -> None:
    hidden = [m for m, p in MODULES.items() if p.stem.startswith("_") and
              p.stem not in ("__init__", "__main__")]
    assert not hidden, hidden


def test_import_graph_has_no_cycle() -> None:
    graph, _ = _graph()
    # the package __init__ files sit on top (they re-export); leave them out of the layering
    inner = {m: {d for d in ds if MODULES[d].name != "__init__.py"}
             for m, ds in graph.items() if MODULES[m].name != "__init__.py"}
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(inner.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(inner):
        if m not in state:
            visit(m)


def test_layers() -> None:
    """Library modules never import the tools; the distributed core never imports the
    public ops, modules or models above it."""
    graph, _ = _graph()
    for m, deps in graph.items():
        if ".tools" not in m and m != f"{PACKAGE}.__main__":
            assert not [d for d in deps if ".tools" in d], (m, deps)
        if ".distributed." in m:
            above = {f"{PACKAGE}.{x}" for x in ("functional", "modules", "models")}
            assert not deps & above, (m, deps & above)


# Below the public ops (functional.py, dilated.py): what the ops are built from.
BELOW_OPS = {f"{PACKAGE}.{m}"
             for m in ("backends", "kernels", "layout", "plan", "launches", "patterns", "merge")}


def test_modules_reach_ranks_only_through_the_public_ops() -> None:
    """modules.py passes its group to the public op (which agrees on the call across ranks)
    and takes its checks from validation.py (and rotary.py, rotary positions' tables and
    rotation, which compute on the rows alone): it never talks to ranks itself."""
    graph, _ = _graph()
    allowed = {f"{PACKAGE}.functional", f"{PACKAGE}.validation", f"{PACKAGE}.rotary"}
    assert graph[f"{PACKAGE}.modules"] <= allowed, graph[f"{PACKAGE}.modules"] - allowed


def test_models_and_integrations_build_on_the_ops() -> None:
    """The models and the transformers backend use the ops, modules and validation, never the
    kernels, plans or merges below them."""
    graph, _ = _graph()
    above = [m for m in graph if m.startswith((f"{PACKAGE}.models", f"{PACKAGE}.integrations"))]
    assert len(above) > 2
    for m in above:
        assert not graph[m] & BELOW_OPS, (m, graph[m] & BELOW_OPS)


# A file is a room of one job; past this many lines it holds several (split it by job).
MAX_LINES = 800


def test_no_library_file_is_too_long() -> None:
    lines = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    long = {m: n for m, n in lines.items() if n > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"


# The modules that may talk to torch.distributed: the communication package, and the
# launchers that create and destroy process groups.
DISTRIBUTED_OWNERS = (f"{PACKAGE}.distributed.comm", f"{PACKAGE}.tools.launch")


def _uses_torch_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(
                a.name.startswith("torch.distributed") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                (node.module or "").startswith("torch.distributed")
                or (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
            return True
        if (isinstance(node, ast.Attribute) and node.attr == "distributed"
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            return True
    return False


def test_only_the_comm_package_talks_to_torch_distributed() -> None:
    """Every collective and process-group call goes through distributed/comm (counted, the
    group an explicit argument); only the launchers in tools/launch.py create groups."""
    talkers = [m for m, p in MODULES.items()
               if _uses_torch_distributed(p)
               and not any(m == o or m.startswith(o + ".") for o in DISTRIBUTED_OWNERS)]
    assert not talkers, talkers


# Per-device tables that are not the memory policy: a kernel's speed (tile sizes, whether a
# kernel is used) stays beside the kernel, and the devices' names in messages.
NOT_MEMORY_POLICY = {f"{PACKAGE}.backends.FUSED_BY_DEFAULT", f"{PACKAGE}.merge.MERGE_KERNEL",
                     f"{PACKAGE}.merge_kernel.BLOCK_ELEMENTS", f"{PACKAGE}.backends._DEVICE_NAMES"}
DEVICE_TYPES = {"cpu", "cuda", "meta"}


def _device_tables(module: str, path: Path) -> List[str]:
    """Module-level names bound to a dict literal keyed by device types."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if isinstance(value, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value in DEVICE_TYPES for k in value.keys):
            found += [f"{module}.{t.id}" for t in targets if isinstance(t, ast.Name)]
    return found


def test_the_memory_policy_lives_in_one_module() -> None:
    """Every per-device size or switch of the memory policy (row blocks, launches, views,
    slices) is a table in policy.py, read through its functions: a second table elsewhere
    would let the plan, the executor and the estimate disagree."""
    tables = [t for m, p in MODULES.items() for t in _device_tables(m, p)]
    assert any(t.startswith(f"{PACKAGE}.policy.") for t in tables)
    stray = [t for t in tables if not t.startswith(f"{PACKAGE}.policy.")
             and t not in NOT_MEMORY_POLICY]
    assert not stray, stray
