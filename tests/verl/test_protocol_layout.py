"""The layout of the `verl.protocol` package: every module imports its siblings one way only (no import circle,
not even under TYPE_CHECKING or inside a function), no class is a mixin, and veRL's public names resolve."""

import ast
from pathlib import Path

import verl.protocol

PACKAGE = Path(verl.protocol.__file__).parent


def sibling_imports(path: Path) -> set[str]:
    """The `verl.protocol.<module>` names a module imports anywhere in its body (the package itself counts as
    `__init__`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl.protocol"):
            parts = node.module.split(".")
            if len(parts) > 2:
                found.add(parts[2])
            else:
                found.update(alias.name for alias in node.names if (PACKAGE / f"{alias.name}.py").exists())
                found.add("__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["verl", "protocol"]:
                    found.add(parts[2] if len(parts) > 2 else "__init__")
    return found


def test_protocol_modules_import_each_other_without_a_circle():
    graph = {path.stem: sibling_imports(path) for path in PACKAGE.glob("*.py")}
    assert "__init__" not in set().union(*(deps for name, deps in graph.items() if name != "__init__")), graph
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import circle: {' -> '.join(stack + (name,))}"
        if name in done:
            return
        for dep in graph.get(name, ()):
            visit(dep, stack + (name,))
        done.add(name)

    for name in graph:
        visit(name, ())
    # the helpers below DataProto know nothing of it
    for low in ("values", "rows", "config", "serialization"):
        assert "data_proto" not in graph[low], (low, graph[low])


def test_protocol_has_no_mixins_and_its_classes_live_in_the_package():
    for path in PACKAGE.glob("*.py"):
        classes = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]
        assert not [c.name for c in classes if c.name.endswith("Mixin")], path
    assert verl.protocol.DataProto.__mro__[1:] == (object,)


def test_verl_public_names_resolve_from_the_package():
    for name in verl.protocol.__all__:
        assert getattr(verl.protocol, name) is not None, name
    from verl import DataProto

    assert DataProto is verl.protocol.DataProto
