"""Ordinary training code on one rank (fake one-rank mesh), where the engine's own
choices show without a second process: which calls are refused, which grads the
optimizer sees, what stays gathered, and which Paddle calls the package avoids. The
numerics across ranks are test_collective/workers/worker_user_code.py's.
"""

import pathlib

import numpy as np
import paddle
import pytest
from paddle.distributed.communication.group import Group

import paddle_hsdp
from paddle_hsdp.comm import gather_tags
from kit import batch_ids, models, shard_tinylm

PACKAGE = pathlib.Path(paddle_hsdp.__file__).parent


def _opt(model, clip=None):
    return paddle.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters(),
                                  weight_decay=0.1, grad_clip=clip)


def test_retain_graph_is_refused_before_the_backward_runs(fake_mesh):
    """Paddle 3.3 segfaults on a second backward through a retained PyLayer: the first
    ``retain_graph=True`` (or ``create_graph``) is refused, nothing ran, and a plain
    backward of the same graph still works."""
    model = shard_tinylm(models.build_model())
    loss = models.lm_loss(model, batch_ids(), True)
    with pytest.raises(NotImplementedError, match="retain_graph.*Nothing ran"):
        loss.backward(retain_graph=True)
    with pytest.raises(NotImplementedError, match="create_graph"):
        paddle.grad(loss, [next(iter(model.parameters()))], create_graph=True)
    assert all(p.grad is None for p in model.parameters())
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())


def test_a_model_with_no_live_graph_may_retain_graphs_of_its_own(fake_mesh):
    """The refusal is about graphs through sharded units: an unrelated retained graph
    works as in plain Paddle once the model's graphs are gone."""
    model = shard_tinylm(models.build_model())
    models.lm_loss(model, batch_ids(), True).backward()
    x = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad.numpy().tolist() == [4.0, 8.0]


def test_a_param_that_never_got_a_grad_is_not_updated(fake_mesh):
    """AdamW with weight decay leaves a parameter without a grad untouched (plain
    Paddle: its grad is None), while the engine holds a zero grad view for it."""
    model = shard_tinylm(models.build_model())
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    opt = _opt(model)
    for _ in range(2):
        models.lm_loss(model, batch_ids(), False).backward()  # Block.extra unused
        opt.step()
        opt.clear_grad()
    after = dict(model.named_parameters())
    for i in range(len(model.blocks)):
        name = f"blocks.{i}.extra"
        assert np.array_equal(after[name].numpy(), before[name]), name
    assert not np.array_equal(after["blocks.0.fc1.weight"].numpy(),
                              before["blocks.0.fc1.weight"])


def test_clip_scales_the_grads_in_place_as_paddle_does(fake_mesh):
    """``step()`` without ``clear_grad()``: the grads carried into the next step are the
    clipped ones, as with Paddle's own ClipGradByGlobalNorm."""
    clip = paddle.nn.ClipGradByGlobalNorm(1e-3)
    model = shard_tinylm(models.build_model())
    opt = _opt(model, clip)
    models.lm_loss(model, batch_ids(), True).backward()
    opt.step()
    carried = {n: p.grad.numpy().copy() for n, p in model.named_parameters()
               if p.grad is not None}
    norm = np.sqrt(sum(float((g.astype("float64") ** 2).sum()) for g in carried.values()))
    assert abs(norm - 1e-3) < 1e-6, norm  # the clipped norm stayed in the grads


def test_a_forward_without_backward_leaves_nothing_gathered(fake_mesh):
    """A forward with grad whose graph is dropped (a skipped batch) does not keep units
    gathered into the next backward: the peak of the next step is a plain step's."""
    model = shard_tinylm(models.build_model())
    opt = _opt(model)

    def step(skip_first):
        if skip_first:
            models.lm_loss(model, batch_ids(), True)
        paddle_hsdp.reset_peak_memory()
        models.lm_loss(model, batch_ids(), True).backward()
        opt.step()
        opt.clear_grad()
        report = paddle_hsdp.memory_report(model)
        return report["peak_gathered_units"], report["peak_gathered"]

    step(False)  # the first step records the forward order (no prefetch yet)
    assert step(True) == step(False)


def _group(ranks):
    return Group(ranks.index(0), -200 - len(ranks), ranks, pg=None, name="fake")


def test_a_unit_skipped_on_some_ranks_is_named_by_the_forward_position(monkeypatch):
    """Two ranks tag the same all-gather after different forwards (one skipped a unit):
    the tags differ only in the forward position, and the message names the units this
    rank ran."""
    monkeypatch.setattr(gather_tags.state, "unit_describer", lambda i: f"unit {i} (u{i})")
    group = _group([0, 1])
    tags = []
    for skipped in (False, True):
        gather_tags.start_forward()
        for unit in ([0, 1, 2] if not skipped else [0, 2]):
            gather_tags.note_forward(unit)
        tags.append(gather_tags.make_tag(group, 2, 0, "compute", lambda: "buf", "float32",
                                         paddle.CPUPlace()).numpy())
        gather_tags._calls[group.id] -= 1  # the same call number on both "ranks"
    assert np.array_equal(tags[0][:gather_tags.POSITION_SLOT],
                          tags[1][:gather_tags.POSITION_SLOT])
    assert tags[0][gather_tags.POSITION_SLOT] != tags[1][gather_tags.POSITION_SLOT]
    with pytest.raises(gather_tags.CollectiveMismatchError,
                       match=r"different units.*this rank ran: unit 0 \(u0\), unit 2"):
        gather_tags.check(paddle.to_tensor(np.stack(tags[::-1])), paddle.to_tensor(tags[1]),
                          group)


def test_the_package_takes_no_view_with_tensor_slice():
    """``Tensor._slice`` leaks a Python list per call in Paddle 3.3 (its Tensor wrapper);
    the package takes views with ``t[a:b]``, which does not."""
    users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if "._slice(" in p.read_text()]
    assert not users, users
