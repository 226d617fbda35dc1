"""The package's shape: layers import one way with no circles, one module imports flax.linen, modules sized by concept.

Read from the source (``ast``), so an import inside a function counts too.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from tests.environment import child_env

pytestmark = pytest.mark.core

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "parallax"
# Lower layers first; a module may import its own layer and the ones before it.
LAYERS = ("sharding", "jaxpr", "models", "parallel", "pricing", "step", "state", "train")
# Shared helpers every layer may use; they import no layer.
FOUNDATION = ("parallax._cache", "parallax._compat", "parallax._errors", "parallax._multihost", "parallax._names",
              "parallax._tree", "parallax._units")
LINEN_ADAPTER = "parallax.models.linen"
MAX_LINES = 600  # a concept per module, up to about this; a longer one is two concepts


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_statements(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """Each absolute import statement in ``path``, at the top or inside a function, as ``(module, names)``:
    ``import a.b`` gives ``("a.b", [])``, ``from a import b, c`` gives ``("a", ["b", "c"])``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def imports(path: pathlib.Path) -> set[str]:
    """Every module name an import statement in ``path`` names (``from a import b`` gives ``a`` and ``a.b``)."""
    return {name for module, names in import_statements(path) for name in (module, *(f"{module}.{n}" for n in names))}


def layer(module: str) -> int | None:
    """The layer index of a parallax module; ``None`` for the foundation, the top package and the tools
    above every layer (inspect, testing and its pytest plugin)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_are_what_the_folders_say():
    assert {m.split(".")[1] for m in MODULES if m.count(".")} == {
        *LAYERS, *(name.split(".")[1] for name in FOUNDATION), "distributed", "inspect", "launch", "plan", "testing",
        "pytest_plugin"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module):
    names = {name for name in imports(MODULES[module]) if name.startswith("parallax")}
    if module in FOUNDATION:
        assert names <= set(FOUNDATION), f"{module} is a shared helper but imports {sorted(names - set(FOUNDATION))}"
        return
    own = layer(module)
    if own is None:
        return  # parallax/__init__ re-exports; inspect reads compiled programs; testing checks whole runs
    upward = sorted(name for name in names if (layer(name) or 0) > own)
    assert not upward, f"{module} (layer {LAYERS[own]}) imports from a layer above it: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_linen_adapter_imports_flax_linen(module):
    linen = sorted(name for name in imports(MODULES[module])
                   if name == "flax.linen" or name.startswith("flax.linen."))
    if module == LINEN_ADAPTER or module.startswith(LINEN_ADAPTER + "."):
        return
    assert not linen, f"{module} imports {linen}; only {LINEN_ADAPTER} may (the model seam)"


def test_the_checks_see_a_violation():
    """The readers above would notice the imports they forbid."""
    sample = PACKAGE / "models" / "linen" / "__init__.py"
    assert "flax.linen" in imports(sample)
    assert layer("parallax.train.trainer") > layer("parallax.step.build") > layer("parallax.models") > layer(
        "parallax.sharding.strategy")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_small(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (> {MAX_LINES}): split it by concern"


def test_import_parallax_leaves_orbax_and_nnx_until_a_run_needs_them(tmp_path):
    """``import parallax`` (in every process a launch starts) does not import orbax, nor flax.nnx for a
    linen user: 0.85 s of its 3 s of CPU (tests/README.md at 5b4d645). A checkpointer imports orbax, an NNX model
    is taken as one once the program has imported flax.nnx."""
    script = (
        "import sys, parallax as px\n"
        "print(sorted(m for m in ('orbax.checkpoint', 'flax.nnx') if m in sys.modules))\n"
        f"px.checkpoint.Checkpointer({str(tmp_path)!r})\n"
        "print('orbax.checkpoint' in sys.modules)\n"
        "from flax import nnx\n"
        "from parallax.models import adapter_for, check_model\n"
        "print(type(adapter_for(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))).__name__)\n"
        "try:\n    check_model(nnx.Linear)\nexcept ValueError as err:\n    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=child_env(JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[:3] == ["[]", "True", "NNXModel"], proc.stdout
    assert "model is the NNX class Linear; pass an instance" in proc.stdout, proc.stdout


def imported_modules(path: pathlib.Path) -> set[str]:
    """The parallax modules ``path`` imports, at the top or inside a function: for ``from a import b``, the module
    ``a.b`` where there is one, else ``a`` (the package whose ``__init__`` defines ``b``)."""
    found = set()
    for module, names in import_statements(path):
        if not names:  # import a.b
            found.add(module)
        for name in names:
            found.add(f"{module}.{name}" if f"{module}.{name}" in MODULES else module)
    return {name for name in found if name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module → the modules it imports): each strongly connected set of two or
    more modules, or one that imports itself (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    """No module imports, even inside a function, one that imports it back (directly or through others): the
    package top (``parallax/__init__``, which re-exports) aside."""
    graph = {module: imported_modules(path) - {"parallax"} for module, path in MODULES.items() if module != "parallax"}
    assert circles(graph) == [], "import circles (function-local imports included): " + "; ".join(
        " <-> ".join(group) for group in circles(graph))


def test_the_circle_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}, "b": set()}) == [["a"]]
    assert circles({"a": {"b"}, "b": set()}) == []
