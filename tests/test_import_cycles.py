"""No import cycle inside kvmetal/: every import statement, at module level or inside a
function, read with ``ast`` (nothing is imported), must leave the module graph acyclic."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict:
    mods = {}
    for f in (ROOT / "kvmetal").rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


def _graph(mods: dict) -> dict:
    graph = {m: set() for m in mods}
    for m, (f, is_pkg) in mods.items():
        here = m.split(".") if is_pkg else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                # "from . import x" names a submodule (some, like _build_info, are generated at build time).
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods or node.module is None else base
                           for a in node.names]
            else:
                continue
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def _cycle(graph: dict):
    """One cycle as a list of modules, or None (depth-first search, three colours)."""
    state, path = {}, []

    def visit(v):
        state[v] = "open"
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = "done"
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycle_inside_kvmetal():
    graph = _graph(_modules())
    assert sum(map(len, graph.values())) > 50  # the scan did find the package's imports
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_test_module_imports_another():
    """Shared test helpers live in plain modules (kvcases, paged_cases, ...), never in a test
    module: importing one runs its fixtures' module-level setup twice and hides where a
    helper lives (tests/README.md)."""
    tests = ROOT / "tests"
    offenders = []
    for f in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{f.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not offenders, offenders


def test_every_test_file_has_an_area():
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import area_of

    assert {area_of(f) for f in (ROOT / "tests").glob("test_*.py")} == {"kernels", "engine", "serve", "models",
                                                                        "tools"}
