"""The code's shape: every family fills in the family interface, the project's modules import each other
without a cycle, and no module outgrows one responsibility (~450 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import models
from models.family import family_members

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450


def project_modules() -> dict[str, Path]:
    """Our importable modules by dotted name: top-level files and the models package."""
    found = {path.stem: path for path in ROOT.glob("*.py")}
    found.update({f"models.{path.stem}": path for path in (ROOT / "models").glob("*.py")})
    found["models"] = found.pop("models.__init__")
    return found


def without_type_checking(tree: ast.Module) -> ast.Module:
    """The module without its `if TYPE_CHECKING:` blocks (imports for annotations never run)."""
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if isinstance(statements, list):
                kept = [s for s in statements if not (isinstance(s, ast.If) and ast.unparse(s.test) == "TYPE_CHECKING")]
                setattr(node, field, kept)
    return tree


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (function-level imports included)."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        package = "models" if name.startswith("models") else ""
        targets = set()
        for node in ast.walk(without_type_checking(ast.parse(path.read_text()))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level else ""
                module = ".".join(part for part in (base, node.module or "") if part)
                submodules = {f"{module}.{alias.name}" for alias in node.names} & set(modules)
                targets |= submodules or {module}  # `from models import cogvideox` imports the submodule
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return path + [node, target]
            if target not in state and (cycle := visit(target, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_no_import_cycle_among_our_modules():
    graph = import_graph()
    assert "sharding" in graph["torchax_runtime"]  # the graph sees real edges
    assert find_cycle(graph) is None, find_cycle(graph)


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_library_modules_do_not_import_the_cli_contract():
    """sharding.py and splash_attention.py are libraries: they raise ValueError, the stages word it."""
    graph = import_graph()
    for library in ("sharding", "splash_attention"):
        assert "utils" not in graph[library], f"{library} imports utils"


@pytest.mark.parametrize("name", sorted(project_modules()))
def test_module_size(name):
    lines = len(project_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by responsibility"


@pytest.mark.parametrize("family", list(models.FAMILIES.values()), ids=list(models.FAMILIES))
def test_family_fills_in_the_interface(family):
    missing = [name for name in family_members() if not hasattr(family, name)]
    assert not missing, f"{family.NAME} lacks {missing}"
    assert {"denoise_loop", "encode_prompts", "validate_request", "Decoder", "PRESETS"} <= set(family_members())
    assert all(preset.family == family.NAME for preset in family.PRESETS.values())


def test_presets_are_unique_and_registered():
    names = [name for family in models.FAMILIES.values() for name in family.PRESETS]
    assert len(names) == len(set(names)) == len(models.PRESETS)


def test_the_package_lists_every_top_level_module():
    """A non-editable install (`pip install .`) ships only the modules pyproject.toml names."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["py-modules"])
    assert listed == {path.stem for path in ROOT.glob("*.py")}
