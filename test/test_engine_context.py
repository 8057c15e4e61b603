"""Issue 52's seams, in one process: the engine's and the communication layer's runtime
state on one object each (engine/context.py, comm/state.py: reset returns it to its
state at import, the engine's refuses during a backward); a group's traits declared as
a record held weakly (comm/traits.py), not attributes read with getattr defaults; every
mesh the engine is given satisfies the Mesh protocol."""

import pytest

from paddle_hsdp.topology.mesh import HCGMesh, Mesh, ProcessMeshGroups
import gc

from paddle_hsdp.comm.state import CommState
from paddle_hsdp.comm.state import state as comm_state
from paddle_hsdp.comm.traits import PLAIN, declare, traits_of
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
    assert state.step_peak == 0 and state.unit_describer is str  # the engine's, kept


def test_traits_are_declared_kept_and_dropped_with_their_group():
    class Group:
        pass
    group = Group()
    assert traits_of(group) is PLAIN and traits_of(None) is PLAIN
    declare(group, watchdog_exempt=True)
    declare(group, pieces="plan")  # keeps what was declared before
    assert traits_of(group).watchdog_exempt and traits_of(group).pieces == "plan"
    assert traits_of(group).early_sync  # the plain default
    assert traits_of({"unhashable": True}) is PLAIN
    before = len(comm_state.group_traits)
    del group
    gc.collect()
    assert len(comm_state.group_traits) == before - 1


MESH_METHODS = ("inner", "outer", "reduce_scatter_group", "fsdp_group", "fsdp_size",
                "mp_rank", "sep_rank", "clip_group", "outer_sharding")


def test_every_mesh_satisfies_the_protocol():
    from kit import FakeMesh as SingleFake
    from test_replicas_and_call_order import FakeMesh as CallOrderFake
    for cls in (HCGMesh, ProcessMeshGroups, SingleFake, CallOrderFake):
        missing = [m for m in MESH_METHODS if not callable(getattr(cls, m, None))]
        assert not missing, (cls.__name__, missing)
    assert all(callable(getattr(Mesh, m, None)) for m in MESH_METHODS)
