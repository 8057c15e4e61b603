"""Full grads written in place into the reduce-scatter's input (engine/buffer/full_grads.py),
in one process (the one-rank fake mesh of kit.py): which path a buffer
takes, that autograd's grads land in the grid, and that a grad which does not is still
reduced. Multi-rank numerics of the same path: every training worker of
test_collective."""

import paddle

import paddle_hsdp
from paddle_hsdp.engine.context import context
from paddle_hsdp.engine.registry import registry as hsdp_registry
from kit import batch_ids, models, parity, shard_tinylm


def _plain_grads(seed=7, prepare=None):
    plain = models.build_model()
    if prepare is not None:
        prepare(plain)
    models.lm_loss(plain, batch_ids(seed), True).backward()
    return {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}


def _assert_grads_match(sharded, reference):
    grads = paddle_hsdp.full_grads(sharded)
    assert set(grads) >= set(reference)
    for name, grad in reference.items():
        parity.assert_close(grads[name].numpy(), grad.numpy(), name)


def test_grads_accumulate_in_the_reduce_input(fake_mesh, float64):
    """Each full grad, when Paddle's post-accumulation hook fires, is a view of its place
    in its buffer's grid (the tied embedding's too: Paddle accumulates a leaf once,
    when the grads of all its uses are in, after the embedding's pre-backward); after
    backward no grid is held, none is counted as full grads, and the grads equal the
    unsharded model's."""
    model = shard_tinylm(models.build_model())
    seen = []

    def check(sp, *_):
        buf = sp.buffer
        if buf.full_grads.grid is None:  # the engine's hook (it runs first) reduced it early
            seen.append(buf.full_grads.reduced_early and sp.full.grad is None)
        else:
            seen.append(sp.full_grad_is_view_of(buf.full_grads.grid))

    for unit in hsdp_registry.units:
        for buf in unit.buffers:
            assert buf.full_grads.in_place() == buf.trainable
            if not buf.trainable:
                continue
            for sp in buf.params:
                sp.full._register_backward_hook(lambda *a, sp=sp: check(sp))
    models.lm_loss(model, batch_ids(), True).backward()
    assert seen and all(seen), seen
    assert all(buf.full_grads.grid is None for u in hsdp_registry.units for buf in u.buffers)
    assert context.staging.grad_bytes == 0
    _assert_grads_match(model, _plain_grads())


def test_grads_that_left_the_grid_are_copied_in_or_zeroed(fake_mesh, float64):
    """A full grad replaced by another tensor after the grid was attached (user code,
    a hook) is copied into the grid; one released is zeroed there and counts as no
    grad: the reduction reads what the parameters' ``.grad`` say at its start."""
    model = paddle_hsdp.fully_shard(paddle.nn.Linear(3, 4))
    (buf,) = [b for b in model._hsdp_unit.buffers if b.trainable]
    weight, bias = buf.params
    model.unshard()
    buf.full_grads.attach_grid()
    assert buf.full_grads.grid is not None
    buf.full_grads.grid.fill_(5.0)  # as if autograd had added grads to both
    buf.full_grads.note_arrived(weight)
    buf.full_grads.note_arrived(bias)
    new = paddle.arange(12, dtype=weight.full.dtype).reshape(weight.shape)
    expected = new.numpy()  # (the grad shares new's storage, released at the reduction)
    weight.full._copy_gradient_from(new)  # replaced: not a view of the grid any more
    bias.full.clear_gradient(False)  # released
    buf.finish_reduce_scatter(buf.start_reduce_scatter())
    assert context.staging.grad_bytes == 0 and weight.full.grad is None
    parity.assert_close(weight.shard.grad.numpy(), expected, "weight")
    assert (weight.grad_here, bias.grad_here) == (True, False)
    assert not bias.shard.grad.numpy().any()


def test_buffers_that_keep_autograd_grads(fake_mesh, float64):
    """A reduce dtype other than the compute dtype keeps the earlier path (grads as
    autograd makes them, concatenated at the reduction); so does a backward that starts
    with full grads present (no grid is attached over them)."""
    model = models.build_model()
    paddle_hsdp.fully_shard(model, mp_policy=paddle_hsdp.MixedPrecisionPolicy(
        reduce_dtype=paddle.float32))
    (buf,) = [b for b in model._hsdp_unit.buffers if b.trainable]
    assert not buf.full_grads.in_place()
    models.lm_loss(model, batch_ids(), True).backward()
    assert buf.full_grads.grid is None

    other = paddle_hsdp.fully_shard(models.build_model())
    (buf,) = [b for b in other._hsdp_unit.buffers if b.trainable]
    assert buf.full_grads.in_place()
    sp = buf.params[0]
    other.unshard()
    sp.full._copy_gradient_from(paddle.zeros(sp.shape, sp.full.dtype))
    buf.full_grads.attach_grid()
    assert buf.full_grads.grid is None  # full grads present: none attached


def test_released_grads_leave_the_flat_storage_alive(fake_mesh, float64):
    """A buffer whose one parameter fills it: its full grad (in the grid) and its shard
    grad (in the flat grad storage) cover their flat tensor's whole range, which Paddle
    slices as the tensor itself. Releasing them (the reduction, ``clear_grad(False)``)
    must not free the flat tensor: three steps train as the unsharded model does."""
    paddle.seed(5)
    plain = paddle.nn.Linear(4, 4, bias_attr=False)
    sharded = paddle.nn.Linear(4, 4, bias_attr=False)
    sharded.weight.set_value(plain.weight)
    paddle_hsdp.fully_shard(sharded)
    (buf,) = sharded._hsdp_unit.buffers
    assert buf.padded_numel == buf.params[0].numel  # no gap, no padding
    opts = [paddle.optimizer.SGD(0.1, parameters=m.parameters()) for m in (plain, sharded)]
    x = paddle.arange(8, dtype=plain.weight.dtype).reshape([2, 4])
    for _ in range(3):
        for model, opt in zip((plain, sharded), opts):
            (model(x) ** 2).sum().backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
    parity.assert_close(paddle_hsdp.full_state_dict(sharded)["weight"].numpy(),
                        plain.weight.numpy(), "weight")
