"""``swarm/`` is the stack docs/architecture.md draws: every import goes down it, none goes round in a circle, and
no file of the engine or the client is over 400 lines. Read from the code's own imports (function-level ones
included) and from the table in the docs, so the two cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWARM = ROOT / "swarm"
MAX_LINES = 400


def documented_layers() -> list[set[str]]:
    """The layers of docs/architecture.md's table, top first: each a set of names like ``round/`` or ``peer.py``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### The engine's layers", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [set(re.findall(r"`([^`]+)`", row.split("|")[1])) for row in rows]


def module_files() -> dict[str, Path]:
    modules = {}
    for path in SWARM.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The swarm modules ``name`` imports, anywhere in its file (``TYPE_CHECKING`` blocks and functions too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target not in ("swarm", name):
                found.add(target)
    return found


def layer_of(name: str, layers: list[set[str]]) -> int:
    parts = name.split(".")
    key = f"{parts[1]}/" if len(parts) > 2 or (SWARM / parts[1]).is_dir() else f"{parts[1]}.py"
    matches = [i for i, names in enumerate(layers) if key in names]
    assert len(matches) == 1, f"{name} ({key}) is not in exactly one layer of docs/architecture.md's table"
    return matches[0]


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_import_goes_down_the_documented_stack():
    layers = documented_layers()
    assert len(layers) >= 8 and {"peer.py", "round/", "state/", "averager/", "dht/"} <= set().union(*layers)
    wrong = []
    for name, imported in graph().items():
        if name == "swarm":  # the package's lazy façade names everything on purpose
            continue
        mine = layer_of(name, layers)
        for other in imported:
            theirs = layer_of(other, layers)
            same_package = name.split(".")[:2] == other.split(".")[:2]
            if theirs < mine or (theirs == mine and not same_package and mine != len(layers) - 1):
                wrong.append(f"{name} imports {other}, which is not below it")
    assert not wrong, "\n".join(wrong)


def test_no_module_of_the_engine_imports_the_peer():
    assert not [name for name, imported in graph().items() if "swarm.peer" in imported and name != "swarm"]


def test_there_is_no_import_circle():
    edges = {name: deps for name, deps in graph().items() if name != "swarm"}
    order, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", "import circle: " + " -> ".join([*trail, node])
        state[node] = "open"
        for dep in sorted(edges.get(node, ())):
            visit(dep, [*trail, node])
        state[node] = "done"
        order.append(node)

    for node in sorted(edges):
        visit(node, [])
    assert len(order) == len(edges)


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    """The two checks above, on a made-up module pair, so a broken parser cannot pass them vacuously."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from swarm.round import pipeline\n")
    b.write_text("def f():\n    from swarm import peer\n")
    modules = {"swarm.round.pipeline": a, "swarm.peer": b, "swarm.dht.view": a}
    assert imports_of("swarm.dht.view", a, modules) == {"swarm.round.pipeline"}
    assert imports_of("swarm.x", b, modules) == {"swarm.peer"}
    layers = documented_layers()
    assert layer_of("swarm.round.pipeline", layers) < layer_of("swarm.dht.view", layers)


def test_no_file_of_the_engine_or_the_client_is_over_400_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for folder in ("swarm", "client")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, long
