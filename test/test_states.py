"""The engine's state machines (engine/states.py, issue 35): one step walks each
through its states in order, and a call out of order is an ``EngineStateError`` at
that call, naming the buffer or unit, the state and what the call needed, before it
touches anything (one rank, the fake mesh; which collectives, not their numbers)."""

import paddle
import pytest

from paddle_hsdp.engine import states
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.engine.states import GradState, ParamState, RebuildState
from kit import batch_ids, models, shard_tinylm


def _trained_one_backward():
    paddle.seed(3)
    model = shard_tinylm(models.build_model())
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    models.lm_loss(model, batch_ids(), True).backward()
    return model, opt


def _trainable(units):
    return [b for u in units for b in u.buffers if b.trainable]


def test_every_member_is_documented():
    source = open(states.__file__).read()
    for machine in (ParamState, GradState, RebuildState):
        for member in machine:
            line = f'    {member.name} = "{member.value}"'
            assert line in source, line
            above = source.split(line)[0].rstrip().splitlines()[-1].strip()
            assert above.startswith("#:"), (member, above)  # its own doc comment


def test_a_step_walks_the_states_in_order(fake_mesh):
    model, opt = _trained_one_backward()
    units = hsdp_registry.units
    assert all(u.state is ParamState.SHARDED for u in units if u.should_reshard_after_forward())
    # backward reduced every trainable buffer; the outer sync is owed
    assert {b.grads.state for b in _trainable(units)} == {GradState.REDUCED}
    assert all(u.grads_pending_outer_sync and not u.grads_synced for u in units)
    opt.step()
    assert {b.grads.state for b in _trainable(units)} == {GradState.SYNCED}
    assert all(u.grads_synced and not u.grads_pending_outer_sync for u in units)
    # a backward without clear_grad: the synced grads go back to summed form, take the
    # new grads and, the step's predicted last backward (one per step so far), are
    # synced again before backward returns (engine/outer_sync.py)
    models.lm_loss(model, batch_ids(seed=8), True).backward()
    assert {b.grads.state for b in _trainable(units)} == {GradState.SYNCED}
    opt.clear_grad()
    assert {b.grads.state for b in _trainable(units)} == {GradState.EMPTY}
    assert not any(u.grads_pending_outer_sync or u.grads_synced for u in units)


def test_prefetch_is_its_own_state(fake_mesh):
    model, _ = _trained_one_backward()
    block = model.blocks[0]._hsdp_unit
    assert block.state is ParamState.SHARDED
    block.prefetch()
    assert block.state is ParamState.GATHERING
    block.reshard()  # a prefetch never used lands and is dropped
    assert block.state is ParamState.SHARDED
    block.prefetch()
    block.unshard()
    assert block.state is ParamState.UNSHARDED
    block.reshard()
    assert block.state is ParamState.SHARDED


def test_out_of_order_calls_raise_at_the_call(fake_mesh):
    model, opt = _trained_one_backward()
    buf = _trainable([model.blocks[0]._hsdp_unit])[0]
    before = buf.grads.acc_flat().numpy().copy()
    # a second wait for a reduce-scatter already landed
    with pytest.raises(states.EngineStateError,
                       match=r"finish_reduce_scatter on .* in state 'reduced'; it runs from "
                             r"'reducing'"):
        buf.finish_reduce_scatter(None)
    opt.step()
    # more grads into synced grads without bringing them back to summed form first
    # (the unit's expect_more_grads does): the silent wrong sum this check prevents
    with pytest.raises(states.EngineStateError, match="start_reduce_scatter on .* 'synced'"):
        buf.start_reduce_scatter()
    with pytest.raises(states.EngineStateError, match="start_outer_sync on .* 'synced'"):
        buf.pieces.start_outer_sync()
    with pytest.raises(states.EngineStateError, match="unsync on .* 'empty'"):
        opt.clear_grad()
        buf.pieces.unsync(1.0)
    assert buf.grads.state is GradState.EMPTY
    # nothing was touched by the refused calls: the model trains on
    models.lm_loss(model, batch_ids(seed=9), True).backward()
    opt.step()
    assert buf.grads.state is GradState.SYNCED and before.shape == buf.grads.acc_flat().shape


def test_unshard_needs_its_gather_issued(fake_mesh):
    model, _ = _trained_one_backward()
    block = model.blocks[0]._hsdp_unit
    block.prefetch = lambda: None  # a prefetch that issued nothing
    with pytest.raises(states.EngineStateError, match=r"unshard on .* 'sharded'; it runs "
                                                      r"from 'gathering'"):
        block.unshard()
    assert block.state is ParamState.SHARDED


def test_an_optimizer_that_overrides_step_gets_the_step_boundary(fake_mesh):
    """An optimizer whose ``step`` never reaches Paddle's ``_apply_optimize`` (Paddle's
    Muon, hand-written ones): its step is wrapped in the boundary all the same, so it
    reads synced grads (the first step's sync runs there), and after its update the
    engine learns the step (the next step's last backward is predicted)."""
    model, _ = _trained_one_backward()
    seen = []

    class ReadsGrads(paddle.optimizer.SGD):
        def step(self):
            seen.extend(b.grads.state for b in _trainable(hsdp_registry.units))

    opt = ReadsGrads(0.1, parameters=model.parameters())
    opt.step()
    assert set(seen) == {GradState.SYNCED}
    opt.clear_grad()
    models.lm_loss(model, batch_ids(seed=8), True).backward()  # predicted last: synced in it
    assert {b.grads.state for b in _trainable(hsdp_registry.units)} == {GradState.SYNCED}
