"""What a tool imports from beyond tools/ and paddle_hsdp, and how it says so when it is
missing. Nothing here touches sys.path.

``python tools/x.py`` (and a launch of ``tools/x.py``) puts tools/ first on sys.path,
and paddle_hsdp is installed (tools/_env.sh: ``pip install -e``). The tools that run the
test tiers' own code in their process (the parity workers' models and bounds, the
collective tier's scenarios) need that folder on PYTHONPATH, set by whoever starts them:
a .sh wrapper, or the command line. A child process gets it through its environment."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join("test_collective", "workers")  # the parity workers' models, bounds
COLLECTIVE = "test_collective"  # the collective tier's scenarios and its launcher


def require(tool: str, folder: str, modules: tuple, command: str = "") -> None:
    """Exit with one line naming ``folder`` (relative to the repository root) when one of
    ``modules`` is not importable: it goes on PYTHONPATH. ``command``: how to run the
    tool with it set (default ``PYTHONPATH=<folder> python tools/<tool>.py ...``).
    Looks the modules up without importing them."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        command = command or f"PYTHONPATH={folder} python tools/{tool}.py ..."
        raise SystemExit(f"{tool}: cannot import {', '.join(missing)} (from {folder}/): put "
                         f"{os.path.join(ROOT, folder)} on PYTHONPATH, e.g. from the "
                         f"repository root: {command}")


def ft_without_paddle(*names: str) -> tuple:
    """``paddle_hsdp.ft``'s Paddle-free modules ``names`` (``protocol``, ``trust``,
    ``etcd_server``, ...), imported without ``paddle_hsdp/__init__.py`` and
    ``paddle_hsdp/ft/__init__.py``, which import Paddle: the one-process simulators run
    thousands of simulated clients and do not pay Paddle's import per process. Empty
    packages stand in for the two (in ``sys.modules``, unless the real ones are there)."""
    import importlib
    import sys
    import types

    for name, path in (("paddle_hsdp", "paddle_hsdp"), ("paddle_hsdp.ft", "paddle_hsdp/ft")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(ROOT, path)]
            sys.modules[name] = module
    return tuple(importlib.import_module(f"paddle_hsdp.ft.{name}") for name in names)
