"""Device-side all-gather tag flags stay bounded without optimizer steps (issue 24,
item 4).

On a device the tag comparison is kept as a device-side flag (no host sync per
all-gather) and read later. Evaluation and generation never step, so the flags are
also read at the end of a root forward without grad or in eval mode, and whenever
their count reaches ``gather_tags.pending_cap()``. ``DEFER_ON_CPU`` forces that path on
CPU; the one-rank fake mesh of kit.py runs the real engine around it.
"""

import paddle
import pytest

from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.comm import gather_tags
from kit import batch_ids, models, shard_tinylm


@pytest.fixture
def deferred(monkeypatch):
    """Tag flags kept as on a device; pending list and step peak restored after."""
    monkeypatch.setattr(gather_tags, "DEFER_ON_CPU", True)
    monkeypatch.setattr(gather_tags.state, "step_peak", 0)
    monkeypatch.setattr(gather_tags, "_pending", [])
    reads = []
    original = gather_tags.raise_pending

    def counting(step=False):
        reads.append(gather_tags.pending_count())
        return original(step)
    monkeypatch.setattr(gather_tags, "raise_pending", counting)
    return reads


def _model():
    model = shard_tinylm(models.build_model())
    models.lm_loss(model, batch_ids(), True).backward()  # records the forward order (prefetch on)
    return model


def test_eval_forwards_keep_no_flags_between_forwards(fake_mesh, deferred):
    """1000 no_grad forwards: every forward's flags are read (one batched read) at its
    end, so nothing accumulates; the same in eval mode with grad on."""
    model = _model()
    ids = batch_ids()[:, :-1]
    per_forward = None
    with paddle.no_grad():
        for i in range(1000):
            model(ids, True)
            assert gather_tags.pending_count() == 0, i
            if per_forward is None:
                per_forward = deferred[-1]
    assert per_forward >= 5  # one read covered every gather of the forward
    assert len(deferred) >= 1000
    model.eval()
    model(ids, True)
    assert gather_tags.pending_count() == 0


def test_forwards_with_grad_that_never_step_stay_under_the_cap(fake_mesh, deferred):
    """Training-mode forwards with grad but no optimizer step (e.g. a loop computing
    losses only): the list is read when it reaches the cap, never grows past it."""
    model = _model()
    ids = batch_ids()[:, :-1]
    cap = gather_tags.pending_cap()
    for _ in range(300):
        model(ids, True)
        assert gather_tags.pending_count() < cap
    assert deferred and max(deferred) < cap + 1


def test_training_steps_are_not_cut_by_extra_reads(fake_mesh, deferred):
    """In training the flags are read once per optimizer step: the step's read sets
    the cap to twice its count, so the cap never fires inside a step."""
    model = _model()
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    for step in range(3):
        models.lm_loss(model, batch_ids(seed=step), True).backward()
        opt.step()
        opt.clear_grad()
    assert len(deferred) == 3, deferred  # the three steps' reads, nothing else
    assert gather_tags.pending_cap() >= 2 * deferred[-1]


def test_mismatch_in_an_eval_forward_is_raised_by_the_end_of_that_forward(
        fake_mesh, deferred, monkeypatch):
    """A peer that gathered another unit during an evaluation forward: the forward
    raises CollectiveMismatchError naming the peer's unit and this rank's calls."""
    model = _model()
    blocks2 = model.blocks[2]._hsdp_unit
    target = model.blocks[1]._hsdp_unit.buffers[0]
    original = comm.all_gather_into

    def peer_gathers_blocks2(out, send, group, *args, **kwargs):
        handle = original(out, send, group, *args, **kwargs)
        if kwargs.get("what") == target.describe:  # the peer's row carries another unit
            row = out._slice(int(out.shape[0]) - gather_tags.TAG_NUMEL, int(out.shape[0]))
            paddle.assign(paddle.to_tensor([blocks2.index, 0, 0, 1, 0], out.dtype),
                          output=row)
        return handle
    monkeypatch.setattr(comm, "all_gather_into", peer_gathers_blocks2)
    ids = batch_ids()[:, :-1]
    with paddle.no_grad():
        with pytest.raises(gather_tags.CollectiveMismatchError) as info:
            model(ids, True)
    message = str(info.value)
    assert "rank 0 was gathering unit" in message and "blocks.2" in message, message
    assert "blocks.1" in message and "(compute)" in message, message  # this rank's calls
    assert gather_tags.pending_count() == 0
    monkeypatch.setattr(comm, "all_gather_into", original)
    with paddle.no_grad():
        model(ids, True)  # the model works again: the forward that raised resharded
    assert all(u._pending_gather is None for u in [blocks2])
