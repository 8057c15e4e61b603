"""Misuse is refused with the argument named, before anything changes (one process, the
one-rank fake mesh of kit.py: these check which calls raise and what they
leave behind; numerics are in test_collective/test_recipes.py)."""


import numpy as np
import paddle
import pytest

import paddle_hsdp
from paddle_hsdp.engine.optimizers import optimizer_params
from paddle_hsdp.engine.registry import registry as hsdp_registry
from kit import (assert_raises_without_side_effects, batch_ids, models, parity, shard_tinylm,
                two_linears)


# ---------------------------------------------------------------- item 10: no trace
def test_rejected_call_changes_nothing_and_a_retry_works(fake_mesh):
    """A call rejected for a bad argument leaves no ignored params, no claimed params:
    the corrected retry shards everything and trains."""
    model = two_linears()
    weight = model[0].weight
    assert_raises_without_side_effects(NotImplementedError, "Shard", model,
                                        ignored_params=[weight],
                                        shard_placement_fn=lambda p: paddle.distributed.Shard(1))
    assert id(weight) not in hsdp_registry.ignored and id(weight) not in hsdp_registry.owner_of
    paddle_hsdp.fully_shard(model)
    assert all(hasattr(p, "_hsdp_sharded_param") for p in model.parameters())
    model(paddle.ones([2, 4])).sum().backward()  # "Tensor holds no memory" before the fix


def test_ignored_params_generator_is_read_once(fake_mesh):
    model = two_linears()
    paddle_hsdp.fully_shard(model, ignored_params=(p for p in [model[0].weight]))
    assert not hasattr(model[0].weight, "_hsdp_sharded_param")  # really ignored
    assert hasattr(model[1].weight, "_hsdp_sharded_param")


def test_ignored_params_of_another_model_do_not_leak(fake_mesh):
    """Params outside the module are not the call's business: the other model's later
    fully_shard shards them."""
    a, b = two_linears(), two_linears()
    paddle_hsdp.fully_shard(a, ignored_params=list(b.parameters()))
    paddle_hsdp.fully_shard(b)
    assert all(hasattr(p, "_hsdp_sharded_param") for p in b.parameters())


def test_ignoring_a_param_a_sub_unit_already_sharded_raises(fake_mesh):
    model = two_linears()
    original = model[0].weight
    paddle_hsdp.fully_shard(model[0])
    assert_raises_without_side_effects(ValueError, "already sharded", model,
                                        ignored_params=[original])


@pytest.mark.parametrize("bad", [paddle.ones([2]), 3, ["not a param"]])
def test_ignored_params_must_be_an_iterable_of_params(fake_mesh, bad):
    assert_raises_without_side_effects(TypeError, "ignored_params", two_linears(),
                                        ignored_params=bad)


# ---------------------------------------------------------------- item 11: bad values
@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", ["int32", paddle.int64, "bf16", 16])
def test_mixed_precision_refuses_non_floating_dtypes(field, dtype):
    with pytest.raises(ValueError, match=field):
        paddle_hsdp.MixedPrecisionPolicy(**{field: dtype})


def test_mixed_precision_accepts_floating_dtypes():
    for dtype in ("bfloat16", "float16", "float32", paddle.bfloat16, None):
        paddle_hsdp.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype="float32")
    with pytest.raises(TypeError, match="cast_forward_inputs"):
        paddle_hsdp.MixedPrecisionPolicy(cast_forward_inputs="False")


@pytest.mark.parametrize("method", ["set_reshard_after_forward", "set_reshard_after_backward",
                                    "set_requires_gradient_sync", "set_requires_all_reduce",
                                    "set_is_last_backward"])
@pytest.mark.parametrize("value", ["False", 0, None])
def test_boolean_setters_refuse_non_bools(fake_mesh, method, value):
    model = paddle_hsdp.fully_shard(two_linears())
    unit = model._hsdp_unit
    before = dict(vars(unit))
    with pytest.raises(TypeError, match=method):
        getattr(model, method)(value)
    assert {k: v for k, v in vars(unit).items()} == before  # nothing set


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), 0, -2.0, True, "2"])
def test_gradient_divide_factor_must_be_finite_positive(fake_mesh, factor):
    model = paddle_hsdp.fully_shard(two_linears())
    with pytest.raises(ValueError, match="set_gradient_divide_factor"):
        model.set_gradient_divide_factor(factor)
    model.set_gradient_divide_factor(8)
    assert model._hsdp_unit.controls.gradient_divide_factor == 8.0


@pytest.mark.parametrize("kwargs", [{"forward": -1}, {"backward": 1.5}, {"forward": True}])
def test_prefetch_count_must_be_a_whole_number(fake_mesh, kwargs):
    model = paddle_hsdp.fully_shard(two_linears())
    with pytest.raises(ValueError, match="set_prefetch_count"):
        model.set_prefetch_count(**kwargs)


@pytest.mark.parametrize("stage", [True, False, 0, 4, "3"])
def test_zero_stage_refuses_bools_and_unknown_stages(fake_mesh, stage):
    model = paddle_hsdp.fully_shard(two_linears())
    with pytest.raises(ValueError, match="stage must be one of"):
        paddle_hsdp.set_zero_stage(model, stage)


@pytest.mark.parametrize("value,expected", [(1, True), (0, False), (True, True), (None, None)])
def test_reshard_after_forward_takes_paddles_ints(fake_mesh, value, expected):
    model = paddle_hsdp.fully_shard(two_linears(), reshard_after_forward=value)
    assert model._hsdp_unit.controls.reshard_after_forward is expected


@pytest.mark.parametrize("value,exc", [(2, NotImplementedError), ("True", TypeError)])
def test_reshard_after_forward_refuses_the_rest(fake_mesh, value, exc):
    assert_raises_without_side_effects(exc, "reshard_after_forward", two_linears(),
                                        reshard_after_forward=value)


def test_mark_expert_params_after_fully_shard_raises(fake_mesh):
    model = paddle_hsdp.fully_shard(two_linears())
    with pytest.raises(RuntimeError, match="before fully_shard"):
        paddle_hsdp.mark_expert_params(model)
    assert not any(getattr(p, "is_moe_param", False) for p in model.parameters())


def test_finish_grad_sync_takes_a_model_an_optimizer_or_params(fake_mesh):
    model = paddle_hsdp.fully_shard(two_linears())
    opt = paddle.optimizer.SGD(parameters=model.parameters())
    model(paddle.ones([2, 4])).sum().backward()
    unit = model._hsdp_unit
    assert unit.grads_pending_outer_sync
    paddle_hsdp.finish_grad_sync(model)  # a model: every unit under it
    assert unit.grads_synced and not unit.grads_pending_outer_sync
    paddle_hsdp.finish_grad_sync(opt)
    paddle_hsdp.finish_grad_sync(list(model.parameters()))
    with pytest.raises(TypeError, match="finish_grad_sync"):
        paddle_hsdp.finish_grad_sync(3)
    with pytest.raises(ValueError, match="no fully_shard unit"):
        paddle_hsdp.finish_grad_sync(paddle.nn.Linear(2, 2))


# ---------------------------------------------------------------- items 6, 7: optimizers
@pytest.mark.parametrize("groups", [False, True], ids=["list", "param_groups"])
@pytest.mark.parametrize("early_step", [False, True], ids=["", "a_step_before"])
def test_optimizer_built_before_the_root_call_takes_the_shards(fake_mesh, groups, early_step):
    """Issue 64 (Paddle's 3.3-era fully_shard test builds its optimizer first): an
    optimizer built from the full parameters before fully_shard trains exactly as one
    built after it, its parameter groups' options kept; state it made in a step before
    the sharding is cut to the shards' rows."""
    def run(early: bool) -> dict:
        model = models.build_model()

        def make():
            params = list(model.parameters())
            if groups:
                params = [{"params": params[:3], "learning_rate": 0.5}, {"params": params[3:]}]
            return paddle.optimizer.AdamW(learning_rate=0.01, parameters=params,
                                          weight_decay=0.1)

        opt = make() if early else None
        if early and early_step:
            models.lm_loss(model, batch_ids(), True).backward()
            opt.step()
            opt.clear_grad()
        paddle_hsdp.fully_shard(model.blocks[0])
        paddle_hsdp.fully_shard(model)
        opt = opt or make()
        for _ in range(2):
            models.lm_loss(model, batch_ids(), True).backward()
            opt.step()
            opt.clear_grad()
        assert all(hasattr(p, "_hsdp_sharded_param") for p in optimizer_params(opt))
        return {n: p.numpy() for n, p in paddle_hsdp.full_state_dict(model).items()}

    early = run(True)
    if early_step:  # the reference: the same step unsharded, then sharded training
        model = models.build_model()
        opt = paddle.optimizer.AdamW(learning_rate=0.01, weight_decay=0.1, parameters=(
            [{"params": list(model.parameters())[:3], "learning_rate": 0.5},
             {"params": list(model.parameters())[3:]}] if groups else model.parameters()))
        for _ in range(3):
            models.lm_loss(model, batch_ids(), True).backward()
            opt.step()
            opt.clear_grad()
        late = {n: p.numpy() for n, p in model.state_dict().items()}
    else:
        late = run(False)
    assert sorted(early) == sorted(late)
    for name in early:
        np.testing.assert_array_equal(early[name], late[name], err_msg=name)


def test_forward_that_raised_leaves_shards_in_the_slots(fake_mesh):
    model = shard_tinylm(models.build_model())
    with pytest.raises(ValueError):
        model(paddle.zeros([2, 99], "int64"), True)  # pos has 6 rows: broadcast fails
    assert all(hasattr(p, "_hsdp_sharded_param") for p in model.parameters())
    assert all(u.state.value == "sharded" for u in hsdp_registry.units)
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    models.lm_loss(model, batch_ids(), True).backward()
    opt.step()  # accepted: it holds the shards


@pytest.mark.parametrize("cls", ["Lamb", "LBFGS"])
def test_non_elementwise_optimizers_are_refused(fake_mesh, cls):
    model = paddle_hsdp.fully_shard(two_linears())
    opt = getattr(paddle.optimizer, cls)(parameters=model.parameters())
    loss = lambda: model(paddle.ones([2, 4])).sum()  # noqa: E731
    loss().backward()
    with pytest.raises(NotImplementedError, match="not element-wise"):
        opt.step() if cls == "Lamb" else opt.step(loss)


# ---------------------------------------------------------------- item 3: direct calls
def test_direct_call_of_a_sub_module_gathers_and_reshards(fake_mesh):
    model = shard_tinylm(models.build_model())
    unit = model._hsdp_unit
    h = paddle.ones([1, 2, models.HIDDEN])
    with paddle.no_grad():
        out = model.final_norm(h)  # a plain sub-module of the root unit
    assert list(out.shape) == [1, 2, models.HIDDEN]
    assert unit.state.value == "sharded"  # resharded after the call (no grad)


def test_clip_grad_norm_on_one_rank_equals_paddles(fake_mesh, float64):
    """With one rank the HSDP clip_grad_norm_ must agree with Paddle's on a twin."""
    sharded, plain = models.build_model(), models.build_model()
    shard_tinylm(sharded)
    for m in (sharded, plain):
        models.lm_loss(m, batch_ids(), True).backward()
    ours = paddle.nn.utils.clip_grad_norm_(sharded.parameters(), 0.1)
    theirs = paddle.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    parity.assert_close(float(ours), float(theirs), "norm")
    grads = paddle_hsdp.full_grads(sharded)
    for name, p in plain.named_parameters():
        if p.grad is not None:
            parity.assert_close(grads[name].numpy(), p.grad.numpy(), name)


def test_optimizer_state_of_another_shape_is_refused_by_key(fake_mesh):
    """Issue 64: set_state_dict keeps each rank's rows of a full state; a tensor of
    neither the full nor the shard's shape is refused, naming its key, and nothing is
    loaded."""
    model = shard_tinylm(models.build_model())
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    models.lm_loss(model, batch_ids(), True).backward()
    opt.step()
    opt.clear_grad()
    state = opt.state_dict()
    key = next(k for k, v in state.items() if "moment1" in k and len(v.shape) == 2)
    before = {k: v.numpy().copy() for k, v in state.items() if hasattr(v, "numpy")}
    with pytest.raises(ValueError, match=f"'{key}'.*neither the full parameter's"):
        opt.set_state_dict(dict(state, **{key: paddle.zeros([3, 3], state[key].dtype)}))
    after = opt.state_dict()
    assert all(np.array_equal(after[k].numpy(), v) for k, v in before.items())


def test_optimizer_states_under_master_weights_are_found(fake_mesh):
    """With multi_precision over bfloat16 parameters Paddle keys the moments by the
    master weight's name (``<name>_fp32_master_0``): checkpoints and
    full_optimizer_state_dict must find them there (they were missed before issue
    64's round trip test)."""
    from paddle_hsdp.engine.optimizers import ensure_accumulators, states_of

    model = models.build_model()
    model.to(dtype="bfloat16")
    shard_tinylm(model)
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), multi_precision=True)
    ensure_accumulators(opt)
    states = states_of(opt, model.blocks[0].fc1.weight)
    assert {"moment1", "moment2", "master_weight"} <= set(states), sorted(states)
    assert states["moment1"].dtype == paddle.float32


def test_an_optimizer_over_a_param_a_failed_fully_shard_left_unsharded_is_refused(fake_mesh):
    """A param claimed by a fully_shard that failed before cutting it (no shard yet) is
    named, with the way out, and nothing is updated (the optimizer check's last case:
    every other full param is swapped for its shard first)."""
    from types import SimpleNamespace

    from paddle_hsdp.engine.optimizers import check_optimizer

    model = two_linears()
    weight = model[0].weight
    before = weight.numpy().copy()
    claimed = SimpleNamespace(fqn="0.weight", full=weight, unit=None)
    hsdp_registry.owner_of[id(weight)] = (SimpleNamespace(module=model[0]), claimed)
    try:
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        with pytest.raises(RuntimeError, match=r"'.*weight'.*fully_shard call that failed.*"
                                               r"call fully_shard on the model again"):
            check_optimizer(opt)
    finally:
        del hsdp_registry.owner_of[id(weight)]
    np.testing.assert_array_equal(weight.numpy(), before)
