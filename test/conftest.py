"""Fixtures shared by the single-process tier (their helpers: kit.py). pytest.ini puts
test/, test_collective/workers (the parity workers' models and bounds, shared by both
tiers) and tools/ on the path: no test inserts into sys.path."""

import paddle
import pytest

import parity
from kit import FakeMesh
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine import api
from paddle_hsdp.engine.context import context
from paddle_hsdp.engine.registry import registry as hsdp_registry


@pytest.fixture
def registry(monkeypatch):
    """An empty unit registry and the engine's runtime state as at import (no forward or
    backward in flight, a fresh staging pool, trace and memory figures:
    ``EngineContext.reset``) for the test, the registry restored after; a fresh comm
    counter (so a test can tell whether any collective was issued). The reset refuses
    while anything is in flight, so a test that leaves a collective or a backward
    behind fails here instead of leaking it into the next."""
    saved = hsdp_registry.saved()
    hsdp_registry.clear()
    context.reset()
    monkeypatch.setattr(comm, "counter", comm.CommCounter())
    yield
    hsdp_registry.restore(saved)
    context.reset()


@pytest.fixture
def fake_mesh(registry, monkeypatch):
    """``fully_shard(mesh=None)`` gets a :class:`kit.FakeMesh` instead of the fleet HCG."""
    mesh = FakeMesh()
    monkeypatch.setattr(api, "resolve_mesh", lambda m: mesh)
    return mesh


@pytest.fixture
def float64():
    """Build this test's models in float64, so its parity checks hold to float64's bound
    (test_collective/workers/parity.py); the default dtype is restored after."""
    before = paddle.get_default_dtype()
    parity.set_dtype("float64")
    yield
    paddle.set_default_dtype(before)
