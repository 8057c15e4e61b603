"""Error paths wait for every collective they issued (issue 24, item 3).

On a device an async collective runs on the communication stream and its buffers go
back to the caching allocator as soon as Python drops them: a handle dropped without
``wait()`` lets the allocator hand out memory the collective may still write. On gloo
and on the one-rank fake mesh everything has completed before it returns, so these
tests count handles instead: ``comm.handles`` records every handle made, waited, and
garbage-collected unwaited (``dropped``). Each path below (a forward that raises, a
gather whose copy-out raises, a backward that raises, a step whose all-reduce wait
raises) must leave ``dropped == 0`` and nothing outstanding, and a program that catches
the error, clears the grads and runs the next batch must train exactly like the
unsharded model on the good batches.
"""

import gc

import paddle
import pytest
from paddle.autograd import PyLayer

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine import outer_sync, reductions
from paddle_hsdp.engine.buffer import ShardBuffer
from paddle_hsdp.engine.buffer.outer_pieces import OuterPieces
from paddle_hsdp.engine.registry import registry as hsdp_registry
from kit import batch_ids, models, parity, shard_tinylm


class Boom(RuntimeError):
    """The injected failure (stands for an out-of-memory error)."""


class _RaiseInBackward(PyLayer):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise Boom("simulated out-of-memory in backward")


@pytest.fixture
def ledger():
    """The handle counts, as a delta from the test's start; asserts nothing was dropped."""
    gc.collect()
    start = comm.handles.snapshot()

    def delta():
        gc.collect()  # a handle in a reference cycle is counted once collected
        now = comm.handles.snapshot()
        return {k: now[k] - start[k] for k in ("issued", "waited", "dropped")} | \
            {"outstanding": now["outstanding"] - start["outstanding"]}
    return delta


def _assert_all_waited(delta):
    d = delta()
    assert d["issued"] > 0, d
    assert d["dropped"] == 0, f"handles garbage-collected without wait(): {d}"
    assert d["outstanding"] == 0, f"handles issued and never waited: {d}"
    assert not reductions.in_flight()
    assert all(u._pending_gather is None for u in hsdp_registry.units)


def _pair(untied_head=False):
    """The sharded model (blocks ZeRO-3, prefetch recorded by one warm-up forward) and
    the unsharded reference, with their optimizers, both after the same first step.
    ``untied_head``: a head weight of its own, the embedding left in the root (whose
    trainable params then make two buffers: the embedding's, the norm's and head's)."""
    ref, model = _build(untied_head), _build(untied_head)
    if untied_head:
        for block in model.blocks:
            paddle_hsdp.fully_shard(block)
        paddle_hsdp.fully_shard(model)
    else:
        shard_tinylm(model)
    paddle_hsdp.set_zero_stage(model, 3)
    ref_opt = models.make_optimizer(ref, ref.parameters(), None)
    opt = models.make_optimizer(model, model.parameters(), None)
    _step(ref, ref_opt, 0)
    _step(model, opt, 0)  # records the forward order: prefetch is on from now
    return ref, ref_opt, model, opt


def _build(untied_head):
    model = models.build_model()
    if untied_head:  # right after the seeded build: both models draw the same values
        model.head = models.TiedHead(model.create_parameter([models.VOCAB, models.HIDDEN]))
    return model


def _step(model, opt, seed):
    loss = models.lm_loss(model, batch_ids(seed=seed), True)
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def _assert_trains_like_reference(ref, ref_opt, model, opt):
    """The batch after the failure: same loss, same parameters as the reference."""
    for seed in (11, 12):
        parity.assert_close(_step(model, opt, seed), _step(ref, ref_opt, seed), "loss")
    full = paddle_hsdp.full_state_dict(model)
    for name, value in ref.state_dict().items():
        parity.assert_close(full[name].numpy(), value.numpy(), name)


def test_a_dropped_handle_is_counted_waited_and_reported(ledger):
    """The detector itself: a handle dropped without wait() is waited by its finalizer
    (the tensors it keeps are alive until then), counted, and warned about."""
    events = []

    class Task:
        def wait(self):
            events.append("waited")

    handle = comm.Handle([Task()], keep=(paddle.zeros([2]),))
    with pytest.warns(comm.UnwaitedCollectiveWarning, match="without wait"):
        del handle
        gc.collect()
    assert events == ["waited"]
    d = ledger()
    assert d["dropped"] == 1 and d["outstanding"] == 0, d
    comm.Handle().wait()
    comm.Handle.completed()
    d = ledger()
    assert d["dropped"] == 1 and d["issued"] == 3 and d["waited"] == 2, d


def test_failed_wait_counts_as_waited(ledger):
    """A wait that raised settled the handle: dropping it after is not reported twice."""
    class Task:
        def wait(self):
            raise OSError("peer closed the connection")

    handle = comm.Handle([Task()])
    with pytest.raises(OSError):
        handle.wait()
    del handle
    assert ledger()["dropped"] == 0
    assert comm.settle([comm.Handle([Task()]), None, comm.Handle()])[0].args == (
        "peer closed the connection",)
    assert ledger()["dropped"] == 0 and ledger()["outstanding"] == 0


def test_forward_that_raises_waits_the_prefetch_and_the_next_batch_trains(
        fake_mesh, float64, ledger, monkeypatch):
    """Block 1 raises inside its forward after its pre-forward prefetched block 2."""
    ref, ref_opt, model, opt = _pair()
    monkeypatch.setattr(model.blocks[1].fc1, "forward",
                        lambda x: (_ for _ in ()).throw(Boom("simulated OOM in forward")))
    with pytest.raises(Boom):
        models.lm_loss(model, batch_ids(seed=5), True)
    monkeypatch.undo()
    opt.clear_grad()
    _assert_all_waited(ledger)
    _assert_trains_like_reference(ref, ref_opt, model, opt)
    _assert_all_waited(ledger)


def test_gather_whose_copy_out_raises_waits_the_other_buffers(fake_mesh, float64, ledger,
                                                             monkeypatch):
    """The root's first buffer raises after its wait (an OOM copying out): the root's
    second buffer (the frozen ``pos``), already issued, is waited for too."""
    ref, ref_opt, model, opt = _pair()
    root = model._hsdp_unit
    assert len(root.buffers) == 2
    original = ShardBuffer.finish_gather

    def failing(self, pending):
        if self is root.buffers[0]:
            pending.handle.wait()
            raise Boom("simulated OOM copying out the gathered grid")
        return original(self, pending)
    monkeypatch.setattr(ShardBuffer, "finish_gather", failing)
    with pytest.raises(Boom):
        models.lm_loss(model, batch_ids(seed=5), True)
    monkeypatch.undo()
    _assert_all_waited(ledger)
    _assert_trains_like_reference(ref, ref_opt, model, opt)
    _assert_all_waited(ledger)


def test_gather_issue_that_raises_waits_the_ones_issued_before(fake_mesh, float64, ledger,
                                                               monkeypatch):
    """Issuing the root's second all-gather raises (an OOM allocating its output): the
    first one, already in flight, is waited for."""
    ref, ref_opt, model, opt = _pair()
    root = model._hsdp_unit
    original = ShardBuffer.start_gather

    def failing(self, *args, **kwargs):
        if self is root.buffers[1]:
            raise Boom("simulated OOM allocating the gather output")
        return original(self, *args, **kwargs)
    monkeypatch.setattr(ShardBuffer, "start_gather", failing)
    with pytest.raises(Boom):
        models.lm_loss(model, batch_ids(seed=5), True)
    monkeypatch.undo()
    _assert_all_waited(ledger)
    _assert_trains_like_reference(ref, ref_opt, model, opt)


def test_backward_that_raises_waits_the_reduce_scatters_in_flight(fake_mesh, float64, ledger):
    """The backward raises between block 1's post-backward (its reduce-scatter is in
    flight) and block 0's: the failed backward waits for it before dropping it, and the
    skipped batch (catch, clear_grad, next batch) leaves training exact."""
    ref, ref_opt, model, opt = _pair()
    hook = model.blocks[0].register_forward_post_hook(
        lambda layer, inputs, out: _RaiseInBackward.apply(out))
    issued = []
    original = ShardBuffer.start_reduce_scatter

    def recording(self, *args, **kwargs):
        issued.append(self.unit_index)
        return original(self, *args, **kwargs)
    ShardBuffer.start_reduce_scatter = recording
    try:
        loss = models.lm_loss(model, batch_ids(seed=5), True)
        with pytest.raises(Exception, match="simulated out-of-memory"):  # Paddle wraps it
            loss.backward()
    finally:
        ShardBuffer.start_reduce_scatter = original
        hook.remove()
    assert model.blocks[1]._hsdp_unit.index in issued  # something was in flight
    del loss
    opt.clear_grad()
    _assert_all_waited(ledger)
    _assert_trains_like_reference(ref, ref_opt, model, opt)
    _assert_all_waited(ledger)


@pytest.mark.parametrize("early", [False, True], ids=["at_step", "during_backward"])
def test_step_whose_all_reduce_raises_waits_the_others(fake_mesh, float64, ledger,
                                                       monkeypatch, early):
    """The step's first outer all-reduce fails after its wait: the others, issued back
    to back with it, are waited for before the error propagates. ``early``: the
    all-reduces were issued during the step's last backward (engine/outer_sync.py: the
    first step counted one backward) and the end of that backward waits for them, so
    the error comes out of ``backward()``, which is abandoned; otherwise out of the
    step."""
    ref, ref_opt, model, opt = _pair()
    monkeypatch.setattr(outer_sync, "ENABLED", early)
    original = OuterPieces.finish_all_reduce
    calls = []

    def failing(self, pending, scale):
        calls.append(self)
        if len(calls) == 1:
            pending.handle.wait()
            raise Boom("simulated failure after the outer all-reduce")
        return original(self, pending, scale)
    monkeypatch.setattr(OuterPieces, "finish_all_reduce", failing)
    loss = models.lm_loss(model, batch_ids(seed=5), True)
    if early:
        with pytest.raises(Boom):
            loss.backward()
    else:
        loss.backward()
        with pytest.raises(Boom):
            opt.step()
    monkeypatch.undo()
    assert len(calls) == 1
    opt.clear_grad()
    _assert_all_waited(ledger)
    _assert_trains_like_reference(ref, ref_opt, model, opt)
    _assert_all_waited(ledger)


def test_end_of_backward_that_raises_waits_and_drops_the_reductions_in_flight(
        fake_mesh, float64, ledger, monkeypatch):
    """At the end of backward the root reduces its two buffers: the second one's
    reduce-scatter raises while the first one's is in flight; it is waited for and
    dropped, not accumulated into the next batch's grads after ``clear_grad``."""
    ref, ref_opt, model, opt = _pair(untied_head=True)
    model.set_reduce_grads_at_end_of_backward(True)
    head = model._hsdp_unit.buffers[-1]
    original = ShardBuffer.start_reduce_scatter

    def failing(self, *args, **kwargs):
        if self is head:
            assert reductions.in_flight()  # the embedding's reduction is in flight
            raise Boom("simulated OOM building the reduce-scatter input")
        return original(self, *args, **kwargs)
    _backward_raises_boom(model, monkeypatch, failing)
    _skip_the_batch_and_train(ref, ref_opt, model, opt, ledger)


def _backward_raises_boom(model, monkeypatch, failing_start_reduce_scatter) -> None:
    """A backward whose ``start_reduce_scatter`` is ``failing_...`` raises Boom."""
    monkeypatch.setattr(ShardBuffer, "start_reduce_scatter", failing_start_reduce_scatter)
    loss = models.lm_loss(model, batch_ids(seed=5), True)
    with pytest.raises(Boom):
        loss.backward()
    monkeypatch.undo()


def _skip_the_batch_and_train(ref, ref_opt, model, opt, ledger) -> None:
    """After a failed batch: clear_grad, then training equals the reference's."""
    opt.clear_grad()
    _assert_all_waited(ledger)
    _assert_trains_like_reference(ref, ref_opt, model, opt)
    _assert_all_waited(ledger)


def test_early_reduction_that_raises_inside_backward(fake_mesh, float64, ledger,
                                                     monkeypatch):
    """The root's final-norm buffer is reduced from a grad hook inside the backward
    (before the blocks'); Paddle does not carry an exception out of such a hook, so the
    engine keeps it and raises it when the backward returns, as it is, after waiting
    for and dropping every reduction in flight."""
    ref, ref_opt, model, opt = _pair()
    root = model._hsdp_unit
    original = ShardBuffer.start_reduce_scatter
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(self.owner)
        if self.owner is root:
            raise Boom("simulated OOM in an early reduction")
        return original(self, *args, **kwargs)
    _backward_raises_boom(model, monkeypatch, failing)
    assert calls[0] is root and len(calls) > 1  # early, and the backward went on
    _skip_the_batch_and_train(ref, ref_opt, model, opt, ledger)
