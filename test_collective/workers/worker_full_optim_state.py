"""A full optimizer state goes in and comes out (issue 64): an unsharded run's
``opt.state_dict()`` (full-size moments) loads with ``opt.set_state_dict`` into 1 x 2
(2 ranks), 1 x 4, 2 x 2 and HFSDP 2 x 2 shards (4 ranks),
``paddle_hsdp.full_optimizer_state_dict`` gives back exactly what went in, and training
goes on exactly as the unsharded run (float64, parity.py's bound, losses and every
parameter), also with the optimizer built before fully_shard.

argv: JSON with the fleet layout (the shared 2 x 2 launch's).
"""

import numpy as np
from common import compare_with_reference, config_from_argv, finish, init_fleet, train_loop
from parity import set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh
from paddle.utils import unique_name

import paddle_hsdp
from paddle_hsdp.engine.optimizers import ensure_accumulators
from models import batches, build_model, lm_loss, make_optimizer, uses_extra

STEPS_BEFORE, STEPS_AFTER, MICRO, PER_RANK, CLIP = 2, 2, 2, 2, 0.2

config = config_from_argv()
set_dtype("float64")
init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS_BEFORE + STEPS_AFTER, MICRO, world, PER_RANK)


def whole_batch_loss(model):
    def micro_loss(micro, _):
        return sum(lm_loss(model, paddle.to_tensor(micro[r * PER_RANK:(r + 1) * PER_RANK]),
                           uses_extra(r)) for r in range(world)) / world
    return micro_loss


def numpy_state(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = numpy_state(value)
        elif isinstance(value, paddle.Tensor):
            out[key] = value.numpy().copy()
        else:
            out[key] = value
    return out


# the unsharded run: STEPS_BEFORE steps, its full state taken, then STEPS_AFTER more
with unique_name.guard():
    ref = build_model()
    ref_opt = make_optimizer(ref, ref.parameters(), CLIP)
    train_loop(ref_opt, data[:STEPS_BEFORE], whole_batch_loss(ref))
    saved_model = {k: v.numpy().copy() for k, v in ref.state_dict().items()}
    saved_opt = numpy_state(ref_opt.state_dict())
    ref_losses = train_loop(ref_opt, data[STEPS_BEFORE:], whole_batch_loss(ref))
ref_params = {k: v.numpy() for k, v in ref.state_dict().items()}
moments = [k for k, v in saved_opt.items() if isinstance(v, np.ndarray) and v.size > 1]
assert moments, sorted(saved_opt)  # full-size moments are in the state


def run(layout: str, mesh, outer_sharding: str, optimizer_first: bool = False) -> None:
    """``optimizer_first``: the optimizer is built before fully_shard, from the full
    parameters (Paddle's 3.3-era fully_shard test does): it takes the shards."""
    with unique_name.guard():
        model = build_model(seed=99)  # other weights: what is loaded must matter
        opt = make_optimizer(model, model.parameters(), CLIP) if optimizer_first else None
        for layer in [model.embed, *model.blocks]:
            paddle_hsdp.fully_shard(layer, mesh=mesh, fsdp_outer_sharding=outer_sharding)
        paddle_hsdp.fully_shard(model, mesh=mesh, fsdp_outer_sharding=outer_sharding)
        opt = opt or make_optimizer(model, model.parameters(), CLIP)
        model.set_state_dict({k: paddle.to_tensor(v) for k, v in saved_model.items()})
        opt.set_state_dict({k: v if not isinstance(v, np.ndarray) else paddle.to_tensor(v)
                            for k, v in saved_opt.items()})
        back = numpy_state(paddle_hsdp.full_optimizer_state_dict(model, opt))
        for key in moments:  # the full state comes back as it went in, bit for bit
            assert np.array_equal(back[key], saved_opt[key]), (layout, key)
        only0 = paddle_hsdp.full_optimizer_state_dict(model, opt, rank0_only=True)
        assert (len(only0) > 0) == (rank == 0), (layout, len(only0))

        def micro_loss(micro, _):
            return lm_loss(model, paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK]),
                           uses_extra(rank))

        losses = train_loop(opt, data[STEPS_BEFORE:], micro_loss, processes=world)
        full = paddle_hsdp.full_state_dict(model)
        worst = {}
        compare_with_reference(f"full optimizer state into {layout}", full, ref_params,
                               losses, ref_losses, worst)
        after = numpy_state(paddle_hsdp.full_optimizer_state_dict(model, opt))
        ref_after = numpy_state(ref_opt.state_dict())
        worst_state = max(float(np.max(np.abs(after[k] - ref_after[k])) /
                                max(np.max(np.abs(ref_after[k])), 1e-30)) for k in moments)
        assert worst_state <= 1e-10, (layout, worst_state)
        print(f"FULL_OPTIM_STATE {layout}: round trip exact ({len(moments)} moments), "
              f"trained on: max rel diff {max(worst.values()):.2e}, moments {worst_state:.2e}",
              flush=True)
        paddle_hsdp.forget(model)


def master_weights_round_trip(outer_sharding: str) -> None:
    """bfloat16 parameters with float32 master weights (AdamW multi_precision): an
    unsharded optimizer's full state, master weights included, goes into the shards
    and comes back bit for bit (no step: this CPU build has no bfloat16 matmul)."""
    rng = np.random.default_rng(5)
    with unique_name.guard():
        ref = build_model()
        ref.to(dtype="bfloat16")
        ref_opt = paddle.optimizer.AdamW(parameters=ref.parameters(), multi_precision=True)
        ensure_accumulators(ref_opt)
        state = {}
        for key, value in ref_opt.state_dict().items():
            if key == "master_weights":
                state[key] = {n: rng.standard_normal(v.shape).astype("float32")
                              for n, v in value.items()}
            elif isinstance(value, paddle.Tensor):
                state[key] = rng.standard_normal(value.shape).astype(str(value.numpy().dtype))
            else:
                state[key] = value
    assert state["master_weights"], "no master weights made"
    with unique_name.guard():
        model = build_model()
        model.to(dtype="bfloat16")
        for layer in [model.embed, *model.blocks]:
            paddle_hsdp.fully_shard(layer, fsdp_outer_sharding=outer_sharding)
        paddle_hsdp.fully_shard(model, fsdp_outer_sharding=outer_sharding)
        opt = paddle.optimizer.AdamW(parameters=model.parameters(), multi_precision=True)
        opt.set_state_dict({k: ({n: paddle.to_tensor(v) for n, v in value.items()}
                                if k == "master_weights" else
                                paddle.to_tensor(value) if isinstance(value, np.ndarray)
                                else value) for k, value in state.items()})
        back = numpy_state(paddle_hsdp.full_optimizer_state_dict(model, opt))
    for name, value in state["master_weights"].items():
        assert np.array_equal(back["master_weights"][name], value), name
    for key, value in state.items():
        if isinstance(value, np.ndarray) and value.size > 1:
            assert np.array_equal(back[key], value), key
    print(f"FULL_OPTIM_STATE master weights {outer_sharding}: "
          f"{len(state['master_weights'])} round trip exact", flush=True)
    paddle_hsdp.forget(model)


if world == 2:  # the 2-rank launch: 1 x 2 (fleet's sharding 2)
    run("1x2", None, "none")
    run("1x2 optimizer first", None, "none", optimizer_first=True)
else:
    run("1x4", ProcessMesh(list(range(world))), "none")
    run("2x2", None, "none")
    run("HFSDP 2x2", None, "optim")
    run("2x2 optimizer first", None, "none", optimizer_first=True)
    master_weights_round_trip("none")
    master_weights_round_trip("optim")
finish()
