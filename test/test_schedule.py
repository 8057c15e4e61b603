"""The engine's schedule in one process (the one-rank fake mesh of kit.py:
collectives are local copies, so this checks the order of issues and waits and the
copies around them, not multi-rank numerics, which test_collective covers)."""

import os


import paddle
import pytest

import paddle_hsdp
from paddle_hsdp.engine import trace
from paddle_hsdp.engine.context import context
from paddle_hsdp.engine.registry import registry as hsdp_registry
from kit import batch_ids, models, parity, shard_tinylm

PACKAGE = os.path.dirname(paddle_hsdp.__file__)
COLLECTIVES = os.path.join("comm", "collectives.py")


def _first(events, event):
    return events.index(event)


def _traced_backward(model, seed=7) -> list:
    """The trace events of one forward and backward of ``model``."""
    trace.enable()
    try:
        models.lm_loss(model, batch_ids(seed), True).backward()
    finally:
        trace.disable()
    return list(trace.recorded().events)


def test_prefetch_and_reductions_are_issued_before_the_neighbouring_compute(fake_mesh):
    """With prefetch 1 under ZeRO-3: unit k+1's all-gather is issued before unit k's
    forward compute starts, and unit k's reduce-scatter before unit k-1's backward
    compute starts; every issued collective is waited for."""
    model = shard_tinylm(models.build_model())
    paddle_hsdp.set_zero_stage(model, 3)
    models.lm_loss(model, batch_ids(), True).backward()  # records the forward order
    blocks = [b._hsdp_unit.index for b in model.blocks]
    ev = _traced_backward(model)
    for k, nxt in zip(blocks, blocks[1:]):
        assert _first(ev, ("issue", "all_gather", nxt)) < _first(ev, ("forward", "compute", k))
    backward = [e for e in ev if e[0] == "backward"]
    for k, prev in zip(blocks[1:], blocks):  # backward runs blocks in reverse
        assert _first(ev, ("issue", "reduce_scatter", k)) < ev.index(("backward", "compute", prev)), ev
    assert backward, ev
    for op in ("all_gather", "reduce_scatter"):
        issued = sum(1 for e in ev if e[:2] == ("issue", op))
        waited = sum(1 for e in ev if e[:2] == ("wait", op))
        assert issued == waited > 0, (op, issued, waited)


def test_copies_around_collectives(fake_mesh, monkeypatch):
    """One training step of a float32 model inside paddle_hsdp: no split and no copy
    after an all-gather (the full parameters are views of its output), no concat before
    a reduce-scatter (autograd accumulated the full grads in its input, the grad grid),
    no clone (flat shards are sent as they are, grads accumulated and all-reduced in
    place), nothing cast."""
    model = shard_tinylm(models.build_model())
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    models.lm_loss(model, batch_ids(), True).backward()  # first step: grad storage made
    opt.step()
    opt.clear_grad()
    counts = {}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            import sys

            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE) and not caller.endswith(COLLECTIVES):
                counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    for name in ("concat", "split"):
        monkeypatch.setattr(paddle, name, counting(name, getattr(paddle, name)))
    for name in ("clone", "astype"):
        monkeypatch.setattr(paddle.Tensor, name, counting(name, getattr(paddle.Tensor, name)))
    trace.enable()
    try:
        models.lm_loss(model, batch_ids(), True).backward()
        opt.step()
    finally:
        trace.disable()
    gathers = sum(1 for e in trace.recorded().events if e[:2] == ("issue", "all_gather"))
    scatters = sum(1 for e in trace.recorded().events if e[:2] == ("issue", "reduce_scatter"))
    assert gathers > 0 and scatters > 0
    assert counts.get("split", 0) == 0, counts
    assert counts.get("concat", 0) == 0 and counts.get("clone", 0) == 0, counts
    assert counts.get("astype", 0) == 0, counts


def test_shard_params_and_grads_are_views_of_flat_storage(fake_mesh):
    model = shard_tinylm(models.build_model())
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    models.lm_loss(model, batch_ids(), True).backward()
    for unit in hsdp_registry.units:
        for buf in unit.buffers:
            for sp in buf.params:
                assert sp.shard_is_view_of(buf.storage.flat)
                if buf.trainable:
                    assert sp.grad_is_view_of(buf.grads.flat)
    opt.step()  # the update is in place: the views survive it
    opt.clear_grad(set_to_zero=False)  # grads released: they read as zeros next time
    models.lm_loss(model, batch_ids(), True).backward()
    for unit in hsdp_registry.units:
        for buf in unit.buffers:
            assert all(sp.shard_is_view_of(buf.storage.flat) for sp in buf.params)


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_switch_gives_the_same_training(fake_mesh, overlap):
    model = models.build_model()
    paddle_hsdp.fully_shard(model.blocks[0], enable_tensor_fusion_and_overlap=overlap)
    paddle_hsdp.fully_shard(model, enable_tensor_fusion_and_overlap=overlap)
    assert model._hsdp_unit.controls.overlap is overlap
    with pytest.raises(TypeError, match="enable_tensor_fusion_and_overlap"):
        paddle_hsdp.fully_shard(models.build_model(), enable_tensor_fusion_and_overlap="no")


def test_unit_called_twice_before_one_backward(fake_mesh, float64):
    """Two forwards (two micro-batches, or one block applied twice) and one backward
    over their sum: a ZeRO-3 unit must stay gathered and keep its grads until the
    backward of every call is done ("Tensor holds no memory" before), and the grads
    equal the unsharded model's."""
    sharded, plain = models.build_model(), models.build_model()
    shard_tinylm(sharded)
    paddle_hsdp.set_zero_stage(sharded, 3)
    for m in (sharded, plain):
        loss = models.lm_loss(m, batch_ids(1), True) + models.lm_loss(m, batch_ids(2), False)
        loss.backward()
    grads = paddle_hsdp.full_grads(sharded)
    for name, p in plain.named_parameters():
        if p.grad is not None:
            parity.assert_close(grads[name].numpy(), p.grad.numpy(), name)
    assert all(u.backward_calls == 0 for u in hsdp_registry.units)


# ---------------------------------------------------------------- the root's grads


def _untied_tinylm():
    """TinyLM with a head weight of its own and the embedding left in the root (as the
    benchmark wraps its model): the root holds the embedding before the blocks, and the
    final norm and the head after them."""
    model = models.build_model()
    model.head = models.TiedHead(model.create_parameter([models.VOCAB, models.HIDDEN]))
    for block in model.blocks:
        paddle_hsdp.fully_shard(block)
    paddle_hsdp.fully_shard(model)
    return model


def _root_reductions(model, ev):
    """Positions in ``ev`` of the root's reduce-scatter issues, of the last block's
    backward compute and of the first block's backward end (the last unit's)."""
    root = model._hsdp_unit.index
    issues = [i for i, e in enumerate(ev) if e == ("issue", "reduce_scatter", root)]
    last_block = ev.index(("backward", "compute", model.blocks[-1]._hsdp_unit.index))
    first_done = ev.index(("backward", "done", model.blocks[0]._hsdp_unit.index))
    return issues, last_block, first_done


def test_the_roots_head_buffer_is_reduced_before_the_end_of_backward(fake_mesh):
    """The root's params are split by the sharded blocks between them: the embedding's
    buffer, and the final norm's and head's. The latter is reduce-scattered as soon as
    its params' grads are complete (before the blocks' backward), the embedding's at the
    end; each once. The end-of-backward mode keeps both for the end."""
    model = _untied_tinylm()
    root = model._hsdp_unit
    assert [[sp.fqn for sp in b.params] for b in root.buffers if b.trainable] == \
        [["embed.weight"], ["final_norm.weight", "final_norm.bias", "head.weight"]]
    models.lm_loss(model, batch_ids(), True).backward()  # records the forward order
    for end_of_backward in (False, True):
        model.set_reduce_grads_at_end_of_backward(end_of_backward)
        ev = _traced_backward(model)
        issues, last_block, first_done = _root_reductions(model, ev)
        assert len(issues) == 2, ev
        if end_of_backward:
            assert issues[0] > first_done, ev
        else:
            assert issues[0] < last_block < first_done < issues[1], ev
        assert ev[-1] == ("backward", "end", root.index)


def test_early_reduction_keeps_accumulation_and_no_sync(fake_mesh, float64):
    """Two micro-steps, the first without grad sync (full grads accumulate), the second
    with it (the head buffer reduced early, the embedding's at the end): the grads equal
    the unsharded model's over both; without sync the root reduces nothing in backward."""
    sharded = _untied_tinylm()
    plain = models.build_model()
    plain.head = models.TiedHead(plain.create_parameter([models.VOCAB, models.HIDDEN]))
    for step, sync in enumerate((False, True)):
        sharded.set_requires_gradient_sync(sync)
        root_issues = _root_reductions(sharded, _traced_backward(sharded, seed=step))[0]
        assert len(root_issues) == (2 if sync else 0), trace.recorded().events
        models.lm_loss(plain, batch_ids(seed=step), True).backward()
    grads = paddle_hsdp.full_grads(sharded)
    for name, p in plain.named_parameters():
        if p.grad is not None:
            parity.assert_close(grads[name].numpy(), p.grad.numpy(), name)


# ---------------------------------------------------------------- staging and the timeline


def test_staging_tensors_are_reused_across_units_and_steps(fake_mesh, monkeypatch):
    """Every all-gather grid, reduce-scatter grid and output comes from the staging pool:
    after the second step (the first records the forward order, prefetch starts with the
    second) no step allocates one, the blocks (one shape) share theirs, and nothing
    stays handed out between steps."""
    pool = context.staging  # a fresh one: the fixture reset the engine's context
    model = shard_tinylm(models.build_model(), reshard_blocks=True)
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    taken = []
    take = pool.take
    monkeypatch.setattr(pool, "take", lambda *a: taken.append(a) or take(*a))
    made = []
    for step in range(4):
        models.lm_loss(model, batch_ids(seed=step), True).backward()
        opt.step()
        opt.clear_grad()
        made.append(pool.allocations)
        assert pool.taken_bytes == 0 and not pool._out, step
    assert 0 < made[0] <= made[1] == made[2] == made[3], made
    # per step: a grid per all-gather, a grid and an output per multi-param reduction
    assert len(taken) > 4 * made[-1], (len(taken), made)
    assert pool.free_count() == made[-1]
    block_sizes = {b.shard_numel for blk in model.blocks for b in blk._hsdp_unit.buffers}
    assert len(block_sizes) == 1  # the blocks share one size: a handful of tensors
    assert made[-1] <= 3 * len(hsdp_registry.units), made


def test_memory_timeline_kinds_and_memory_report(fake_mesh):
    """The timeline has a row per event with every kind; after forward, backward and the
    step its last row gives what memory_report gives; the kinds show up where they
    should (gathered in forward, full grads in backward, optimizer state after a step)."""
    model = shard_tinylm(models.build_model(), reshard_blocks=False)
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    trace.enable(memory=True, rss=True)
    try:
        loss = models.lm_loss(model, batch_ids(), True)
        checks = [(trace.recorded().timeline[-1], paddle_hsdp.memory_report(model))]
        loss.backward()
        checks.append((trace.recorded().timeline[-1], paddle_hsdp.memory_report(model)))
        opt.step()
        checks.append((trace.recorded().timeline[-1], paddle_hsdp.memory_report(model)))
    finally:
        trace.disable()
    rows = list(trace.recorded().timeline)
    assert len(rows) == len(trace.recorded().events)
    assert [row["event"] for row in (c[0] for c in checks)] == \
        ["forward done", "backward end", "step done"]
    for row, report in checks:
        assert row["shard"] == report["shard"] > 0, (row, report)
        assert row["shard_grad"] + row["full_grad"] == report["grad"], (row, report)
        assert row["gathered"] == report["gathered"], (row, report)
        assert row["staging"] == report["staging"], (row, report)
        assert set(trace.KINDS) | {"t", "event", "unit", "rss"} == set(row), row
    assert max(r["gathered"] for r in rows) > 0 and max(r["full_grad"] for r in rows) > 0
    assert rows[-1]["optimizer"] > 0 and rows[0]["optimizer"] == 0
    assert all(b["t"] >= a["t"] for a, b in zip(rows, rows[1:]))
