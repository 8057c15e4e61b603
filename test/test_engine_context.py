"""The engine's and the communication layer's runtime state on one object each
(engine/context.py, comm/state.py; issue 52): reset returns it to its state at import,
and the engine's refuses while a backward is under way."""

import pytest

from paddle_hsdp.comm.state import CommState
from paddle_hsdp.engine.context import EngineContext


def test_reset_returns_the_engine_state_to_import_and_keeps_the_autograd_wrappers():
    ctx = EngineContext()
    ctx.backward.autograd_wrapped = True
    ctx.backward.active.append("unit")
    ctx.trace.on = ctx.warned_cpu_offload = True
    ctx.offload.counters.uploads, ctx.offload.issued = 3, 7
    ctx.reset()
    assert ctx.backward.active == [] and ctx.backward.autograd_wrapped
    assert not ctx.trace.on and not ctx.warned_cpu_offload
    assert ctx.offload.counters.uploads == 0 and ctx.offload.issued == 0


def test_reset_is_refused_during_a_backward():
    ctx = EngineContext()
    ctx.backward.depth = 1
    with pytest.raises(RuntimeError, match="during a backward: 0 root.*depth 1"):
        ctx.reset()
    ctx.backward.depth = 0
    ctx.backward.roots_in_backward.append("root")
    with pytest.raises(RuntimeError, match="1 root"):
        ctx.reset()


def test_comm_state_reset_keeps_its_threads(monkeypatch):
    monkeypatch.delenv("PADDLE_HSDP_CHECK_COLLECTIVES", raising=False)
    state = CommState()
    state.comm_thread, state.fingerprint_on, state.step_peak = "thread", True, 9
    state.unit_describer = str
    state.reset()
    assert state.comm_thread == "thread" and not state.fingerprint_on
    assert state.step_peak == 0 and state.unit_describer is None
