"""The code's shape: every family fills in the family interface, the project's modules import each other
without a cycle (packages included), no module outgrows one responsibility (~450 lines), the libraries
that must run without JAX import none, and the wheel ships every module of the tree."""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tpu_video import models
from tpu_video.models.family import family_members

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
MAX_MODELS_LINES = 300
# Our packages: every folder at the top holding an __init__.py (tests and benchmarks hold none): the one package.
PACKAGES = tuple(sorted(path.parent.name for path in ROOT.glob("*/__init__.py")))
PACKAGE = "tpu_video"


@functools.cache
def project_modules() -> dict[str, Path]:
    """Our importable modules by dotted name: top-level files and every module of our packages and their
    subpackages (a subpackage needs its own __init__.py, or the wheel would miss it)."""
    found = {path.stem: path for path in ROOT.glob("*.py")}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if path.stem == "__init__" else parts)] = path
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


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (function-level imports included)."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(without_type_checking(ast.parse(path.read_text()))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""  # `..` climbs one package
                module = ".".join(part for part in (base, node.module or "") if part)
                submodules = {f"{module}.{alias.name}" for alias in node.names} & set(modules)
                targets |= submodules or {module}  # `from tpu_video.models import cogvideox` imports the submodule
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def imports_anywhere(name: str) -> set[str]:
    """Every module `name` imports, directly or through our other modules, third-party roots included."""
    modules, graph, seen, todo, external = project_modules(), import_graph(), set(), [name], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for node in ast.walk(without_type_checking(ast.parse(modules[current].read_text()))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            external |= {n.split(".")[0] for n in names}
        todo += sorted(graph[current])
    return external


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
    assert "sharding" in graph["tpu_video.runtime.torchax_runtime"]  # the graph sees real edges
    assert find_cycle(graph) is None, find_cycle(graph)


# docs/architecture.md draws these layers: a module imports from its own layer or the ones below.
LAYERS = [
    ("tpu_video", "tpu_video.cli"),
    # "tpu_video.runtime": its opening
    (
        "utils",
        "sharding",
        "tpu_video.runtime",
        "tpu_video.runtime.interface",
        "tpu_video.program_checks",
        "tpu_video.workarounds",
    ),
    ("tpu_video.attention", "tpu_video.runtime.mesh"),
    (
        "splash_attention",
        "tpu_video.runtime.sdpa",
        "tpu_video.runtime.placement",
        "tpu_video.runtime.torchax_runtime",
        "tpu_video.runtime.programs",
        "tpu_video.runtime.program_key",
        "tpu_video.runtime.executables",
        "tpu_video.runtime.backend",
        "tpu_video.runtime.distributed",
    ),
    ("tpu_video.engine",),
    ("tpu_video.models",),
    ("tpu_video.planning",),
    ("tpu_video.stages", "tpu_video.api"),
    ("stage1_text_encoder", "stage2_transformer", "stage3_vae_decoder"),
]


def layer_of(name: str) -> int:
    matches = [
        (len(prefix), index)
        for index, names in enumerate(LAYERS)
        for prefix in names
        if name == prefix or name.startswith(prefix + ".")
    ]
    assert matches, f"{name} is in no layer of docs/architecture.md"
    return max(matches)[1]


def test_imports_go_down_the_layers():
    graph = import_graph()
    upward = [(a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, upward
    assert layer_of("tpu_video.runtime.torchax_runtime") == 3  # the longest matching name wins


def package_of(module: str) -> str:
    """A module's room in the import structure: its subpackage of tpu_video (models with its families), a module
    at tpu_video's top, or a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == PACKAGE and len(parts) > 1 else module


def test_packages_import_one_another_without_a_cycle():
    """At the package level too: the attention package below the Splash kernel below the runtime, no loop."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module)
        )
    for targets in list(graph.values()):
        for target in targets:
            graph.setdefault(target, set())
    assert find_cycle(graph) is None, find_cycle(graph)
    assert "tpu_video.runtime" in graph["tpu_video.engine"]  # the graph sees real edges


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_library_modules_do_not_import_the_cli_contract():
    """sharding.py and splash_attention.py are libraries: they raise ValueError, the stages word it."""
    graph = import_graph()
    for library in ("sharding", "splash_attention"):
        assert not graph[library] & {"tpu_video.cli", "utils"}, (
            f"{library} imports the CLI conventions or the file contract"
        )


# Where flags are built and parsed namespaces read: the CLI conventions and the stages (and the scripts).
FLAG_LAYERS = ("tpu_video.cli", "tpu_video.stages", "tpu_video.api", "stage1_text_encoder", "stage2_transformer")


def test_no_flags_below_the_cli_layer():
    """The engine, families, runtime, attention and planning take settings, not flags: none of them imports
    argparse or adds an argument (tpu_video/stages/feature_flags.py builds the engine features' flags)."""
    found = []
    for name, path in project_modules().items():
        if name.startswith(FLAG_LAYERS) or name == "stage3_vae_decoder":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            imported = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                imported = [node.module or ""]
            attribute = node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else ""
            if "argparse" in imported or attribute in ("add_argument", "add_argument_group"):
                found.append(f"{name}:{node.lineno}")
    assert not found, found


@pytest.mark.parametrize("name", sorted(project_modules()))
def test_module_size(name):
    """450 lines at most; 300 in the families and the engine (tpu_video/models/, tpu_video/engine/), where new
    families land."""
    lines = len(project_modules()[name].read_text().splitlines())
    limit = MAX_MODELS_LINES if name.startswith(("tpu_video.models", "tpu_video.engine")) else MAX_LINES
    assert lines <= limit, f"{name} has {lines} lines (at most {limit}); split it by responsibility"


@pytest.mark.parametrize("family", list(models.FAMILIES.values()), ids=list(models.FAMILIES))
def test_family_fills_in_the_interface(family):
    """Every member the protocol names exists in this family, its methods are callable, its presets are its own."""
    from tpu_video.models.family import Family

    missing = [name for name in family_members() if not hasattr(family, name)]
    assert not missing, f"{family.NAME} lacks {missing}"
    methods = [name for name in family_members() if callable(getattr(Family, name, None))]
    assert not [name for name in methods if not callable(getattr(family, name))], f"{family.NAME}: not callable"
    assert family.PRESETS and all(preset.family == family.NAME for preset in family.PRESETS.values())


def test_the_family_protocol_names_the_core_members():
    """family_members() reads the protocol itself, so the per-family check above covers what stages call."""
    assert {"denoise_loop", "prompt_encoder", "validate_request", "Decoder", "PRESETS"} <= set(family_members())


def test_presets_are_unique_and_registered():
    names = [name for family in models.FAMILIES.values() for name in family.PRESETS]
    assert len(names) == len(set(names)) == len(models.PRESETS)


@pytest.mark.parametrize(
    "name",
    [
        "tpu_video.cli",
        "utils",
        "tpu_video.engine.batch_folders",
        "sharding",
        "tpu_video.runtime",
        "tpu_video.runtime.interface",
        "tpu_video.runtime.mesh",
        "tpu_video.workarounds",
        "tpu_video.attention",
        "tpu_video.attention.plan",
        "tpu_video.attention.calls",
        "tpu_video.attention.sp_modes",
        "tpu_video.planning",
    ],
)
def test_jax_free_modules_import_no_jax(name):
    """Stage 1 and stage 3 --backend torch load these on hosts without JAX (function-level imports count)."""
    assert not imports_anywhere(name) & {"jax", "jaxlib", "torchax"}


def test_jax_free_check_sees_jax():
    assert "jax" in imports_anywhere("tpu_video.runtime.torchax_runtime")


def test_every_package_opens_with_a_docstring():
    openings = [path for path in project_modules().values() if path.name == "__init__.py"]
    assert PACKAGES == (PACKAGE,) and len(openings) >= 9
    for path in openings:
        assert ast.get_docstring(ast.parse(path.read_text())), path


@pytest.mark.parametrize("package", sorted(name for name, path in project_modules().items() if path.stem == "__init__"))
def test_a_package_docstring_names_real_modules_and_all_of_them(package):
    """A name in backquotes in a package's opening is one of its modules (the mesh axes aside), and an opening
    that names its modules names every one: the docstring is the package's table of contents."""
    doc = ast.get_docstring(ast.parse(project_modules()[package].read_text())) or ""
    named = set(re.findall(r"`([a-z_][a-z0-9_]*)`", doc)) - {"dp", "sp", "tp"}
    depth = package.count(".") + 1
    children = {
        name.rsplit(".", 1)[1]
        for name in project_modules()
        if name.startswith(f"{package}.") and name.count(".") == depth
    }
    assert named <= children, f"{package}'s docstring names {sorted(named - children)}, which are not its modules"
    assert not named or named == children, f"{package}'s docstring leaves out {sorted(children - named)}"


def test_every_folder_of_a_package_is_a_subpackage():
    """A folder of modules without __init__.py would be left out of the wheel and of these checks."""
    for package in PACKAGES:
        for folder in (ROOT / package).rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__" and list(folder.glob("*.py")):
                assert (folder / "__init__.py").exists(), folder


def test_the_wheel_ships_every_module(tmp_path):
    """A non-editable install (`pip install .`) ships only what pyproject.toml names: build the wheel."""
    source = tmp_path / "source"  # a copy: building in place would leave build/ and egg-info in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, source],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    expected = {str(path.relative_to(ROOT)) for path in project_modules().values()}
    assert shipped == expected
    # Installed without the checkout (`pip install .`), every module imports from the installed copy.
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target", site, wheel]
    assert subprocess.run(install, capture_output=True, text=True).returncode == 0
    names = sorted(project_modules())
    check = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(site)!r}), module.__file__\n"
        "print(len(sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    imported = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert imported.returncode == 0, imported.stderr[-3000:]
    # The installed commands keep the CLI conventions: a user error is one `error:` line and exit 2.
    for stage in ("stage1", "stage2", "stage3"):
        command = [site / "bin" / f"tpu-video-{stage}", "--dtype", "int8"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error:"), done.stderr[-2000:]


def test_no_test_module_imports_another_and_no_benchmark_imports_a_test():
    """Shared test code lives in tests/helpers.py and tests/conftest.py; benchmarks stand on the product."""
    test_modules = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    for path in [*(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        forbidden = test_modules | ({"helpers", "conftest"} if path.parent.name == "benchmarks" else set())
        assert not imported & forbidden, f"{path.relative_to(ROOT)} imports {sorted(imported & forbidden)}"
