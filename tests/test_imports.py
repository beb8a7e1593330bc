"""Import rules (docs/design/architecture.md), read from the source with ``ast``.

Every import counts: top level and function-local (a local import still ties the
packages together; it only hides the tie from the interpreter). The rules:

1. No import circle between the packages (common, ps, controller, workers, meta_io,
   models, delivery, protos, metaps, bench).
2. Floors: the ground floor (``common``) imports nothing but itself, ``protos``, the
   standard library and third-party packages; the subsystems import the ground floor,
   never the top floor (``metaps``) or the benches (``bench``); nothing but ``bench``
   itself imports ``bench``.
3. ``ps`` and ``controller`` do not import each other.
4. No import circle between *modules* anywhere in the tree (every project module;
   function-local and ``TYPE_CHECKING`` imports count). ``MODULE_CIRCLES_KNOWN`` is the
   shrinking allow-list of circles not yet broken (empty: issue 12 broke the last ones,
   ``controller.dds`` <-> ``ledger``, ``controller.policy`` <-> ``policy_dd``/``policy_nd``
   and ``controller.server`` <-> ``servicer``).

``KNOWN`` lists today's violations, each with the issue-12 point that removes it. It
may only shrink: a new violation fails, and so does an entry that no longer occurs
(delete it when its fix lands).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "ps", "controller", "workers", "meta_io", "models", "delivery", "metaps", "protos", "bench")
TOP = ("metaps", "bench")  # the floors above the subsystems

def _is_ground(module: str) -> bool:
    """The ground floor is the ``common`` package."""
    return _pkg(module) == "common"

# (importing module, imported package or module) -> the issue-12 point that removes it.
KNOWN: dict[tuple[str, str], str] = {
    # empty: issue 12 removed the last ones (role entry points on the app floor, PS fleet
    # operations behind controller/ports.py). A new violation fails.
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(module: str, is_pkg: bool, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    # `from pkg import mod` imports pkg.mod when it is a module; keep both readings.
    return [stem] + [f"{stem}.{a.name}" for a in node.names]


def read_imports() -> dict[str, set[str]]:
    """Every project module -> the project modules/packages it imports (any depth)."""
    modules: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            modules[_module_name(path)] = path
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(name, path.name == "__init__.py", node):
                    if t.split(".")[0] in PACKAGES:
                        # the longest prefix that is a real module (or the package itself)
                        parts = t.split(".")
                        while len(parts) > 1 and ".".join(parts) not in modules:
                            parts.pop()
                        found.add(".".join(parts))
        found.discard(name)
        out[name] = found
    return out


IMPORTS = read_imports()


def _pkg(module: str) -> str:
    return module.split(".")[0]


def _node(module: str) -> str:
    """The unit of the circle rule: a package."""
    return _pkg(module)


def violations() -> dict[tuple[str, str], str]:
    """(module, imported package or module) -> which rule it breaks (rules 2 and 3)."""
    bad: dict[tuple[str, str], str] = {}
    for mod, targets in IMPORTS.items():
        for t in targets:
            if _is_ground(mod) and not _is_ground(t) and _pkg(t) != "protos":
                bad[(mod, _pkg(t))] = "ground floor imports a higher floor"
            if _pkg(mod) not in TOP and _pkg(t) in TOP:
                bad[(mod, t)] = f"a lower floor imports the top floor ({_pkg(t)})"
            if _pkg(mod) == "metaps" and _pkg(t) == "bench":
                bad[(mod, t)] = "the product imports a bench"
            if {_pkg(mod), _pkg(t)} == {"ps", "controller"}:
                bad[(mod, _pkg(t))] = "ps and controller import each other"
    return bad


def package_graph(skip: set[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, targets in IMPORTS.items():
        for t in targets:
            if _node(t) != _node(mod) and (mod, _pkg(t)) not in skip and (mod, t) not in skip:
                graph[_node(mod)].add(_node(t))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_reader_sees_local_and_relative_imports() -> None:
    # function-local imports count (controller.types imports meta_io only inside DatasetSpec.from_meta_io)
    assert "meta_io.reader" in IMPORTS["controller.types"]
    assert "common.errors" in IMPORTS["ps.errors"]
    assert "bench.quality_setup" in IMPORTS["bench.deepfm_parity"]


def test_no_new_floor_or_ps_controller_violation() -> None:
    found = violations()
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, "new import-rule violations (docs/design/architecture.md):\n" + "\n".join(
        f"  {m} imports {t}: {why}" for (m, t), why in sorted(new.items()))


def test_no_import_circle_between_packages() -> None:
    cycle = find_cycle(package_graph(set(KNOWN)))
    if cycle:
        edges = [(a, b) for a, b in zip(cycle, cycle[1:])]
        where = {e: sorted(m for m, ts in IMPORTS.items() if _node(m) == e[0] and any(_node(t) == e[1] for t in ts))
                 for e in edges}
        raise AssertionError("import circle " + " -> ".join(cycle) + "; made by: "
                             + "; ".join(f"{a}->{b}: {', '.join(ms[:5])}" for (a, b), ms in where.items()))


def test_known_violations_still_occur() -> None:
    """The allow-list only shrinks: drop an entry once its fix has landed."""
    found = violations()
    gone = [k for k in KNOWN if k not in found and not _still_in_cycle(k)]
    assert not gone, f"fixed, remove from KNOWN: {gone}"


def _still_in_cycle(key: tuple[str, str]) -> bool:
    mod, target = key
    return any(t == target or _pkg(t) == target for t in IMPORTS.get(mod, ()))


# Module circles not yet broken: frozenset of the circle's modules -> why it is still there.
# Only shrinks (an entry whose circle is gone fails test_known_module_circles_still_occur).
MODULE_CIRCLES_KNOWN: dict[frozenset[str], str] = {}


def module_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports (package ``__init__`` included)."""
    return {m: {t for t in ts if t in IMPORTS} for m, ts in IMPORTS.items()}


def module_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles of ``graph``: its strongly connected parts of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(frozenset(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_module_circles_are_found() -> None:
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}, "b": {"b.c"}, "b.c": set()}
    assert module_circles(graph) == [frozenset({"a.x", "a.y", "a.z"})]


def test_no_import_circle_between_modules() -> None:
    graph = module_graph()
    new = [c for c in module_circles(graph) if c not in MODULE_CIRCLES_KNOWN]
    lines = []
    for c in new:
        edges = sorted(f"{a} -> {b}" for a in c for b in graph[a] & c)
        lines.append(f"  circle {sorted(c)}: " + "; ".join(edges))
    assert not new, ("module import circles (break them: move what both need into a small module, "
                     "or type a dependency by a Protocol):\n" + "\n".join(lines))


def test_known_module_circles_still_occur() -> None:
    found = set(module_circles(module_graph()))
    gone = [sorted(c) for c in MODULE_CIRCLES_KNOWN if c not in found]
    assert not gone, f"circle broken, remove from MODULE_CIRCLES_KNOWN: {gone}"
