"""The project's modules import each other without a cycle, counting the imports
inside functions too: a function-level import only hides a cycle, it does not
remove it (every caller still needs both modules to make sense of either)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("accounts", "portal", "tpus", "testfleet", "bench", "tests")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            modules[module_name(path)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (module level,
    functions, methods), resolved to the module that runs: ``from tpus.services
    import grants`` is an import of ``tpus.services.grants``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_nearest_known(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else _nearest_known(base, known))
    found.discard(None)
    found.discard(name)
    return found


def _nearest_known(dotted: str, known: set[str]) -> str | None:
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm,
    iterative so a deep graph cannot hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [
        f"  {source} -> {target}"
        for source in component
        for target in sorted(graph[source] & members)
    ]
    return "\n".join([f"cycle of {len(component)} modules:", *edges])


def test_the_project_has_no_import_cycle_counting_imports_inside_functions():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "\n\n".join(describe(c, graph) for c in found)


# Where accounts still asks tpus a question: who administers a lab (admins must use
# two-factor; their sign-ins go to their labs' logs), whether a key is one of the
# portal's lab keys, and which VMs must follow a person's key change. tpus depends on
# accounts (people, keys, unix accounts); nothing else in accounts may reach into tpus.
ACCOUNTS_ASKS_TPUS = {
    ("accounts.services", "tpus.access"),
    ("accounts.keys", "tpus.models"),
    ("accounts.keys", "tpus.services.access_changes"),
    ("accounts.admin", "tpus.services.access_changes"),
    # The one home of what may reach a worker (key types, the username pattern): a plain
    # module without Django that the hosts' own checks are generated from.
    ("accounts.sshkeys", "tpus.remote.rules"),
    ("accounts.usernames", "tpus.remote.rules"),
}


def _edges(graph, source_app: str, target_app: str) -> set[tuple[str, str]]:
    return {
        (source, target)
        for source, targets in graph.items()
        if source.split(".")[0] == source_app and ".tests" not in source
        for target in targets
        if target.split(".")[0] == target_app
    }


def test_accounts_reaches_into_tpus_only_where_it_must_ask_about_labs():
    """The audit log is written through ``portal.audit``, so recording what happened
    needs no tpus import; what is left is listed above and may only shrink."""
    assert _edges(import_graph(), "accounts", "tpus") <= ACCOUNTS_ASKS_TPUS


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The check itself can fail: two modules that import each other, one of them only
    inside a function, are reported as one cycle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "one.py").write_text("from pkg import two\n")
    (package / "two.py").write_text("def later():\n    from . import one\n")
    known = {"pkg", "pkg.one", "pkg.two"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = {
            name: imported_modules(name, tmp_path / (name.replace(".", "/") + ".py"), known)
            for name in ("pkg.one", "pkg.two")
        }
    finally:
        ROOT = saved
    assert found == {"pkg.one": {"pkg.two"}, "pkg.two": {"pkg.one"}}
    assert cycles({"pkg": set(), **found}) == [["pkg.one", "pkg.two"]]
