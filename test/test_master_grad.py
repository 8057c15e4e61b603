"""Paddle's mixed-precision recipes over shards, in one process on the 1-rank fake mesh:
the master-grad wrappers (``MixPrecisionLayer`` / ``MixPrecisionOptimizer``) and
``paddle.amp.decorate(level="O2")``.

With one rank every collective is a copy, so these check the plumbing: the engine fills
the shards' float32 ``main_grad`` (views of one flat tensor), accumulates it over
micro-steps as Paddle's hook does, leaves ``.grad`` None, and refuses what cannot be
right before any collective. The multi-rank runs are test_collective's
worker_master_grad.py. On CPU Paddle's bf16 autocast and ``amp.decorate`` change
nothing (they act on GPU, XPU and custom devices only) and CPU has no bf16 kernels to
train a cast model with; the cast decorate makes on a GPU is called here directly
(``amp_initialize``) to see what it does to shards.
"""

import numpy as np
import paddle
import pytest
from paddle.amp.auto_cast import _set_multi_precision, amp_initialize
from paddle.distributed.fleet.utils.mix_precision_utils import (MixPrecisionLayer,
                                                                 MixPrecisionOptimizer)

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.optimizers import ensure_accumulators, states_of
from kit import batch_ids, models, parity, shard_tinylm

MICRO, CLIP = 2, 0.2


def _wrapped(order):
    """TinyLM under MixPrecisionLayer / MixPrecisionOptimizer; ``order``: the wrapper
    "before" or "after" fully_shard, or None (unsharded: the reference)."""
    model = models.build_model()
    if order == "before":
        wrapper = MixPrecisionLayer(model, dtype="bfloat16")
    if order is not None:
        shard_tinylm(model)
    if order != "before":
        wrapper = MixPrecisionLayer(model, dtype="bfloat16")
    opt = MixPrecisionOptimizer(models.make_optimizer(model, model.parameters(), CLIP))
    return model, wrapper, opt


def _trainable(opt):
    return [p for p in opt._parameter_list if not p.stop_gradient]


@pytest.mark.parametrize("order", ["after", "before"])
def test_wrappers_match_the_unsharded_model_micro_step_by_micro_step(fake_mesh, order):
    """3 steps of 2 micro-steps, clipping active: after every backward the shards'
    main_grad is float32, the unsharded one's value accumulated so far (Paddle's hook
    adds each micro-step's grad), a view of the buffer's flat main grads, and ``.grad``
    stays None; losses and parameters match at the end (float32 bound)."""
    ref, ref_wrapper, ref_opt = _wrapped(None)
    model, wrapper, opt = _wrapped(order)
    shards = _trainable(opt)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    losses, ref_losses = [], []
    for step in range(3):
        for micro in range(MICRO):
            ids = batch_ids(seed=10 * step + micro)
            for w, out in ((ref_wrapper, ref_losses), (wrapper, losses)):
                loss = models.lm_loss(w, ids, micro == 0)  # Block.extra: 1st micro-step only
                (loss / MICRO).backward()
                out.append(float(loss))
            for p in shards:
                assert p.grad is None and p.main_grad.dtype == paddle.float32, names[id(p)]
                sp = p._hsdp_sharded_param
                flat = paddle_hsdp.engine.registry.registry.buffer_of(sp).grads.flat_main
                assert sp.main_grad_is_view_of(flat), names[id(p)]
                want = ref_params[names[id(p)]].main_grad.numpy()
                parity.assert_close(p.main_grad.numpy()[:want.shape[0]], want, names[id(p)])
            assert all(p.grad is None for p in ref.parameters())
        ref_opt.step()
        opt.step()
        assert paddle_hsdp.last_global_norm(opt) > CLIP  # the clip read the main grads
        ref_opt.clear_grad()
        opt.clear_grad()
        assert all(float(p.main_grad.abs().sum()) == 0 for p in shards)  # zeroed in place
    parity.assert_close(losses, ref_losses, "losses")
    full = paddle_hsdp.full_state_dict(model)
    for name, value in ref.state_dict().items():
        parity.assert_close(full[name].numpy(), value.numpy(), name)


def test_clear_grad_releases_main_grads_and_drops_deferred_grads(fake_mesh):
    """``clear_grad(set_to_zero=False)`` releases main_grad (the next backward makes a
    new view); under ZeRO-1 it also drops the full-size float32 main_grad that the hook
    accumulated for the deferred reduce-scatter (a skipped batch is skipped)."""
    model, wrapper, opt = _wrapped("before")
    paddle_hsdp.set_zero_stage(model, 1)
    shards = _trainable(opt)
    models.lm_loss(wrapper, batch_ids(), True).backward()
    units = paddle_hsdp.engine.registry.registry.units_under(model)
    assert any(u.full_grads_pending for u in units)
    full = [p._hsdp_sharded_param.full for p in shards]
    assert any(f.main_grad is not None and f.main_grad.dtype == paddle.float32 for f in full)
    opt.clear_grad(set_to_zero=False)
    assert not any(u.full_grads_pending for u in units)
    assert all(f.main_grad is None for f in full) and all(p.main_grad is None for p in shards)
    models.lm_loss(wrapper, batch_ids(seed=3), True).backward()
    paddle_hsdp.finish_grad_sync(opt)
    assert all(p.main_grad is not None and p.grad is None for p in shards)


def test_wrapper_over_part_of_a_buffer_is_refused_before_any_collective(fake_mesh):
    """MixPrecisionLayer over fc1 alone (fc2, the norm and ``extra`` share its unit's
    buffer, one collective) is refused at the next forward, naming MixedPrecisionPolicy."""
    model = shard_tinylm(models.build_model())
    MixPrecisionLayer(model.blocks[0].fc1, dtype="bfloat16")
    before = comm.counter.snapshot()
    with pytest.raises(NotImplementedError, match="MixPrecisionLayer covers") as info:
        models.lm_loss(model, batch_ids(), True)
    assert "MixedPrecisionPolicy" in str(info.value) and "blocks.0" in str(info.value)
    assert comm.counter.snapshot() == before


@pytest.mark.parametrize("when", ["before", "after"])
def test_amp_decorate_o2_changes_nothing_on_cpu(fake_mesh, when):
    """decorate(level="O2") returns at once off GPU/XPU/custom devices: before or after
    fully_shard, parameters stay float32 and shards stay views of their buffer."""
    model = models.build_model()
    if when == "after":
        shard_tinylm(model)
    model = paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
    if when == "before":
        shard_tinylm(model)
    opt = models.make_optimizer(model, model.parameters(), CLIP)
    model, opt = paddle.amp.decorate(models=model, optimizers=opt, level="O2",
                                     dtype="bfloat16", master_weight=True)
    assert all(p.dtype == paddle.float32 for p in model.parameters())
    assert not opt._multi_precision
    for p in model.parameters():
        sp = p._hsdp_sharded_param
        assert sp.shard_is_view_of(paddle_hsdp.engine.registry.registry.buffer_of(sp).storage.flat)
    models.lm_loss(model, batch_ids(), True).backward()
    opt.step()


def test_decorate_cast_after_fully_shard_is_refused_before_any_collective(fake_mesh):
    """What decorate(level="O2") does on a GPU after fully_shard: cast every parameter
    the model yields, i.e. the shards, in place. Their buffer stays float32, so the next
    gather would quietly copy the float32 values back; the next forward refuses it
    instead, naming the parameter, the order that works and MixedPrecisionPolicy."""
    model = shard_tinylm(models.build_model())
    amp_initialize(models=[model], dtype="bfloat16", excluded_layers=None)
    before = comm.counter.snapshot()
    with pytest.raises(NotImplementedError, match="after fully_shard") as info:
        models.lm_loss(model, batch_ids(), True)
    message = str(info.value)
    assert "before fully_shard" in message and "MixedPrecisionPolicy" in message
    assert comm.counter.snapshot() == before


def _cast_then_sharded(seed=2024):
    """What decorate(level="O2") does on a GPU, before fully_shard: the cast, then the
    optimizer (built on the shards) in multi-precision. The recipe's second decorate,
    with the optimizer after fully_shard, casts nothing more: called here too."""
    model = models.build_model(seed)
    amp_initialize(models=[model], dtype="bfloat16", excluded_layers=None)
    wrapper = MixPrecisionLayer(model, dtype="bfloat16")
    shard_tinylm(model)
    opt = models.make_optimizer(model, model.parameters(), CLIP)
    amp_initialize(models=[model], dtype="bfloat16", excluded_layers=None)  # a no-op now
    _set_multi_precision(opt, True)
    return model, wrapper, opt


def test_decorate_cast_before_fully_shard_gives_bf16_shards_and_fp32_masters(fake_mesh,
                                                                            tmp_path):
    """decorate's cast before fully_shard: buffers are built in bfloat16 and shards are
    bf16 views of them; with MixPrecisionLayer a backward gives float32 main grads (CPU
    computes the gathered bf16 weights in float32); the optimizer's multi-precision
    master weights are float32 copies of the shards, and a checkpoint brings them back
    into another such model. (CPU has no bf16 AdamW kernel, so no step here.)"""
    model, wrapper, opt = _cast_then_sharded()
    registry_ = paddle_hsdp.engine.registry.registry
    buffers = [b for u in registry_.units_under(model) for b in u.buffers]
    assert {b.dtype for b in buffers} == {paddle.bfloat16}
    for p in model.parameters():
        sp = p._hsdp_sharded_param
        assert p.dtype == paddle.bfloat16 and sp.shard_is_view_of(registry_.buffer_of(sp).storage.flat)
    models.lm_loss(wrapper, batch_ids(), True).backward()
    shards = [p for p in model.parameters() if not p.stop_gradient]
    assert all(p.grad is None and p.main_grad.dtype == paddle.float32 for p in shards)
    ensure_accumulators(opt)
    for p in shards:
        master = states_of(opt, p)["master_weight"]
        assert master.dtype == paddle.float32
        assert np.array_equal(master.numpy(), p.astype("float32").numpy()), p.name
        master.add_(paddle.full_like(master, 0.5))  # unlike any fresh model's masters
    paddle_hsdp.save_checkpoint(tmp_path / "ckpt", wrapper, opt)
    other, other_wrapper, other_opt = _cast_then_sharded(seed=3)
    paddle_hsdp.load_checkpoint(tmp_path / "ckpt", other_wrapper, other_opt)
    for p, q in zip(shards, [p for p in other.parameters() if not p.stop_gradient]):
        assert np.array_equal(states_of(opt, p)["master_weight"].numpy(),
                              states_of(other_opt, q)["master_weight"].numpy()), p.name


@pytest.mark.parametrize("reduce_dtype,travels", [(None, paddle.float32),
                                                  ("bfloat16", paddle.bfloat16)])
def test_main_grads_travel_in_float32_unless_the_policy_names_a_reduce_dtype(
        fake_mesh, reduce_dtype, travels):
    """Under a MixedPrecisionPolicy(param_dtype="bfloat16") the plain grads would travel
    in bf16; main grads travel in float32, as Paddle's main_grad all-reduce does, unless
    the policy names a reduce_dtype. They land in float32 either way."""
    policy = paddle_hsdp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype=reduce_dtype)
    model = models.shard_tinylm(models.build_model(), mp_policy=policy)
    wrapper = MixPrecisionLayer(model, dtype="bfloat16")
    buffers = [b for u in paddle_hsdp.engine.registry.registry.units_under(model)
               for b in u.buffers if b.trainable]
    assert {b.grads.reduce_dtype() for b in buffers} == {travels}
    models.lm_loss(wrapper, batch_ids(), True).backward()
    shards = [p for p in model.parameters() if not p.stop_gradient]
    assert all(p.grad is None and p.main_grad.dtype == paddle.float32 for p in shards)



@pytest.mark.parametrize("set_to_zero", [True, False])
def test_a_plain_optimizers_clear_grad_clears_the_shards_main_grad(fake_mesh, set_to_zero):
    """MixPrecisionLayer with a plain optimizer (it steps on main_grad): its clear_grad
    zeroes the shards' main_grad, or releases it with set_to_zero=False, as Paddle's
    own ZeRO optimizer does (issue 47: it was left as it was)."""
    model = shard_tinylm(models.build_model())
    net = MixPrecisionLayer(model, dtype="bfloat16")
    opt = paddle.optimizer.AdamW(0.1, parameters=model.parameters())
    models.lm_loss(net, batch_ids(), True).backward()
    opt.step()
    opt.clear_grad(set_to_zero=set_to_zero)
    shards = [p for p in model.parameters() if not p.stop_gradient]
    if set_to_zero:
        assert all(not np.any(p.main_grad.numpy()) for p in shards)
    else:
        assert all(p.main_grad is None for p in shards)
    models.lm_loss(net, batch_ids(seed=8), True).backward()  # the engine fills them again
    assert all(p.main_grad is not None for p in shards)


def test_a_penalty_on_the_shards_lands_in_their_main_grads(fake_mesh):
    """A loss term on ``model.parameters()`` under MixPrecisionLayer reaches the shards
    directly (grad_hooks._on_shard_grad): it is added to the main grads, and the
    shards' ``.grad`` stays None, as unsharded (it once crashed at the end of backward,
    then left the term in ``.grad`` as well)."""
    ref, ref_wrapper, _ = _wrapped(None)
    model, wrapper, opt = _wrapped("after")
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    for w, net in ((ref_wrapper, ref), (wrapper, model)):
        params = [p for p in net.parameters() if not p.stop_gradient]
        loss = models.lm_loss(w, batch_ids(seed=4), True) + \
            0.5 * sum((p.astype("float32") ** 2).sum() for p in params)
        loss.backward()
    for p in _trainable(opt):
        assert p.grad is None, names[id(p)]
        want = ref_params[names[id(p)]].main_grad.numpy()
        parity.assert_close(p.main_grad.numpy()[:want.shape[0]], want, names[id(p)])
