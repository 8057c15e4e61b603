"""Lint and types in the test command (issue 52): ruff (ruff.toml: pyflakes, bugbear, no
``global``) on the packages whose state and seams the engine-state restructure tidies,
and mypy (mypy.ini) on the whole of paddle_hsdp; both green, so a new finding fails the
suite. A class count keeps every engine object at 20 fields or fewer, and a function
measure (issue 68) every function of ft/, engine/ and comm/ at 50 lines or fewer, nested
4 deep at most."""

import ast
import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
CHECKED = ["paddle_hsdp/comm", "paddle_hsdp/topology", "paddle_hsdp/optim", "paddle_hsdp/engine",
           "paddle_hsdp/ft"]
TYPED = ["paddle_hsdp"]


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    path = path if os.path.exists(path) else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install the test extra (pip install -e .[test])")
    return path


def test_ruff_finds_nothing():
    run = subprocess.run([_tool("ruff"), "check", "--no-cache", *CHECKED], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_tests_have_no_pyflakes_finding():
    """test/ under pyflakes alone: no fixture imported from another test module (F811),
    nothing unused."""
    run = subprocess.run([_tool("ruff"), "check", "--no-cache", "--select", "F", "test"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_finds_nothing():
    run = subprocess.run([_tool("mypy"), "--no-incremental", *TYPED], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def _stored_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class stores: ``self.<name> = ...`` anywhere in its body, and its
    class-level fields (dataclass fields, annotated or assigned names)."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                        and sub.value.id == "self":
                    names.add(sub.attr)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets
                      if isinstance(t, ast.Name) and not t.id.isupper()}
    return names


def test_no_engine_class_holds_over_20_attributes():
    """Issue 52: an engine object that holds more than 20 fields is doing several
    jobs; its parts become components (the buffer's, engine/buffer/) or records (a
    unit's settings, engine/controls.py). Counted with the engine's base classes."""
    classes = {}
    for path in glob.glob(os.path.join(ROOT, "paddle_hsdp", "engine", "**", "*.py"),
                          recursive=True):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                classes[node.name] = (_stored_attributes(node), bases)

    def count(name: str) -> set[str]:
        own, bases = classes[name]
        return own.union(*(count(b) for b in bases if b in classes))
    sizes = {name: len(count(name)) for name in classes}
    assert sizes["ShardBuffer"] > 10 and sizes["FSDPUnit"] > 10  # the count sees them
    assert {n: s for n, s in sizes.items() if s > 20} == {}


# ---------------------------------------------------------------- function size (issue 68)
SIZED = ["paddle_hsdp/ft", "paddle_hsdp/engine", "paddle_hsdp/comm"]
MAX_LINES, MAX_NESTING = 50, 4
_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
             ast.Match, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _blocks(statement: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists one level inside a compound statement; an ``elif``'s (an
    ``If`` alone in its parent's ``orelse``) at its ``if``'s level, as it is written."""
    if isinstance(statement, ast.If):
        rest = statement.orelse
        elif_ = len(rest) == 1 and isinstance(rest[0], ast.If) and \
            rest[0].col_offset == statement.col_offset
        return [statement.body, *(_blocks(rest[0]) if elif_ else [rest])]
    if isinstance(statement, ast.Match):
        return [case.body for case in statement.cases]
    handlers = [h.body for h in getattr(statement, "handlers", [])]
    return [statement.body, getattr(statement, "orelse", []),
            getattr(statement, "finalbody", []), *handlers]


def _nesting(statements: list[ast.stmt]) -> int:
    """How deep compound statements (if/for/while/with/try/match) sit inside each other;
    a function or class defined inside is measured as its own."""
    return max((1 + max(map(_nesting, _blocks(s))) for s in statements
                if isinstance(s, _COMPOUND)), default=0)


def _lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From ``def`` to the function's last line, its docstring left out: a long
    docstring explains, it is not the several-jobs-in-one smell the limit is for
    (decorators are not counted either; a nested function's lines are its parent's)."""
    lines = function.end_lineno - function.lineno + 1
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
            isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _sizes(source: str) -> list[tuple[str, int, int, int]]:
    """(qualified name, line, lines, nesting) of every function in ``source``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = getattr(child, "name", "")
            if isinstance(child, _DEFS):
                found.append((prefix + name, child.lineno, _lines(child),
                              _nesting(child.body)))
            visit(child, prefix + name + "." if isinstance(child, (*_DEFS, ast.ClassDef))
                  else prefix)
    visit(ast.parse(source), "")
    return found


def _over_the_limits() -> dict[str, dict[str, str]]:
    """{file: {function: 'file:line function: N lines, nesting D'}} over a limit."""
    over: dict[str, dict[str, str]] = {}
    for folder in SIZED:
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"),
                                     recursive=True)):
            name = os.path.relpath(path, ROOT)
            for function, line, lines, nesting in _sizes(open(path).read()):
                if lines > MAX_LINES or nesting > MAX_NESTING:
                    over.setdefault(name, {})[function] = \
                        f"{name}:{line} {function}: {lines} lines, nesting {nesting}"
    return over


def test_the_function_size_measure_sees_what_it_should():
    """The measure itself: a long body and deep nesting are found, a docstring and an
    ``elif`` chain are not held against a function."""
    def body(indent: str) -> str:
        return "".join(f"{indent}x = {i}\n" for i in range(MAX_LINES - 1))
    doc = '    """' + "\n" * 30 + '    """\n'
    deep = "def deep():\n" + "".join("    " * (i + 1) + "if x:\n" for i in range(5)) + \
        "    " * 6 + "pass\n"
    chain = "def chain(x):\n    if x:\n        pass\n" + \
        "".join(f"    elif x == {i}:\n        pass\n" for i in range(8))
    sizes = {name: (lines, nesting) for name, _, lines, nesting in _sizes(
        f"def fits():\n{doc}{body('    ')}\nclass C:\n    def long(self):\n"
        f"{body('        ')}        y = 1\n"
        f"\n{deep}\n{chain}\ndef nested_else(x):\n    if x:\n        pass\n    else:\n"
        f"        if x:\n            pass\n")}
    assert sizes == {"fits": (MAX_LINES, 0), "C.long": (MAX_LINES + 1, 0),
                     "deep": (7, 5), "chain": (19, 1), "nested_else": (6, 2)}


def test_no_function_is_over_50_lines_or_nested_over_4():
    """Issue 68: a function of ft/, engine/ or comm/ over 50 lines, or with compound
    statements nested over 4 deep, does several jobs: split it into named steps (ft's
    attempt of a step is an object with one method per phase, ft/replica.py)."""
    found = [why for functions in _over_the_limits().values() for why in functions.values()]
    assert found == [], "over the limits:\n" + "\n".join(found)
