"""The package's layering (issue 17): ``lint-imports`` keeps the contracts of
``.importlinter`` (hints < comm < topology < optim < engine < patches < checkpoint | config <
__main__ | integrations, checkpoint and config independent, no cycle between siblings),
and a few rules the contracts cannot say, read from grimp's import graph."""

import configparser
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
PACKAGE = "paddle_hsdp"


def _lint_imports() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    script = script if os.path.exists(script) else shutil.which("lint-imports")
    if script is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e .[test])")
    return [script]


def test_lint_imports_keeps_every_contract():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    run = subprocess.run(_lint_imports() + ["--no-cache"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


@pytest.fixture(scope="module")
def graph():
    grimp = pytest.importorskip("grimp")  # installed with import-linter
    return grimp.build_graph(PACKAGE, cache_dir=None)  # (the root: pytest.ini's pythonpath)


@pytest.fixture(scope="module")
def runtime_graph():
    """The imports that run: those under ``if TYPE_CHECKING:`` (a buffer's parts naming
    their buffer) left out."""
    grimp = pytest.importorskip("grimp")
    return grimp.build_graph(PACKAGE, cache_dir=None, exclude_type_checking_imports=True)


def test_no_import_cycle_between_modules(runtime_graph):
    """Tarjan's strongly connected components over every module of the package, by the
    imports that run (.importlinter's sibling contract names the type-only ones it
    allows)."""
    graph = runtime_graph
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert cycles == []


# the engine modules each seam may import: every other one is named forbidden
_SEAMS = {"ft-seam": {"replication"}, "checkpoint-seam": {"holdings", "saved_names", "layout"}}


@pytest.mark.parametrize("contract", sorted(_SEAMS))
def test_a_seam_forbids_every_other_engine_module(graph, contract):
    """ft and checkpoint each reach the engine through their seam alone: the contract's
    list names every other engine module (one added to the engine and not to the list
    would be open to them)."""
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, ".importlinter"))
    listed = set(config[f"importlinter:contract:{contract}"]["forbidden_modules"].split())
    engine = {m for m in graph.find_children(f"{PACKAGE}.engine")}
    allowed = {f"{PACKAGE}.engine.{name}" for name in _SEAMS[contract]}
    assert allowed <= engine, allowed - engine
    assert engine - allowed - listed == set()
    assert listed & allowed == set()


def test_registry_imports_nothing_of_the_package(graph):
    assert graph.find_modules_directly_imported_by(f"{PACKAGE}.engine.registry") == set()


def test_nothing_imports_the_top_level_package(graph):
    """``paddle_hsdp/__init__`` sits above every layer (it installs the patches)."""
    assert graph.find_modules_that_directly_import(PACKAGE) == set()


def test_no_two_test_modules_share_a_name():
    """The tiers have no __init__.py: pytest imports test modules by basename, and two
    of one name (test/x.py, test_collective/x.py) stop collection of the whole run."""
    names = {}
    for tier in ("test", "test_collective"):
        for name in os.listdir(os.path.join(ROOT, tier)):
            if name.startswith("test_") and name.endswith(".py"):
                names.setdefault(name, []).append(tier)
    assert not {n: t for n, t in names.items() if len(t) > 1}
