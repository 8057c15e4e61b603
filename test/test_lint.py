"""Lint in the test command (issue 52): ruff (ruff.toml: pyflakes and bugbear) on the
packages whose state and seams the engine-state restructure tidies; green from the
start, so a new finding fails the suite."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
CHECKED = ["paddle_hsdp/comm", "paddle_hsdp/topology", "paddle_hsdp/engine", "paddle_hsdp/ft"]


def test_ruff_finds_nothing():
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    ruff = ruff if os.path.exists(ruff) else shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff not found: install the test extra (pip install -e .[test])")
    run = subprocess.run([ruff, "check", "--no-cache", *CHECKED], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
