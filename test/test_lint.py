"""Lint and types in the test command (issue 52): ruff (ruff.toml: pyflakes, bugbear, no
``global``) on the packages whose state and seams the engine-state restructure tidies,
and mypy (mypy.ini) on those it has finished (comm/, topology/, ft/); green from the
start, so a new finding fails the suite."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
CHECKED = ["paddle_hsdp/comm", "paddle_hsdp/topology", "paddle_hsdp/engine", "paddle_hsdp/ft"]
TYPED = ["paddle_hsdp/comm", "paddle_hsdp/topology", "paddle_hsdp/ft"]


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
