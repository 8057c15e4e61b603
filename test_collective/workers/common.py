"""Shared set-up for the multi-process workers."""

from __future__ import annotations

import json
import sys

import numpy as np

import parity
from parity import max_rel  # noqa: F401  (the workers' one relative-difference measure)

import paddle_hsdp  # must precede fleet.init
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

MOE_ORDER = ["dp", "pp", "moe_sharding", "ep", "sharding", "sep", "cp", "mp"]


def init_fleet(config: dict):
    """``config``: hybrid degrees, ``outer`` (fsdp_outer_degree), optional ``moe``."""
    strategy = fleet.DistributedStrategy()
    hybrid = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    hybrid.update({k: v for k, v in config.items() if k.endswith("_degree")})
    hybrid["sharding_configs"] = {"fsdp_outer_degree": config.get("outer", 1)}
    if hybrid.get("ep_degree", 1) > 1:
        strategy.hybrid_parallel_order = MOE_ORDER
    strategy.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def config_from_argv() -> dict:
    return json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}


def finish() -> None:
    # rank 0 owns the TCP store: nobody leaves before everybody is done.
    dist.barrier()
    print("WORKER_OK", flush=True)


def rank_sum_check(group, what: str) -> None:
    """An all-reduce of the global rank over ``group`` must give the sum of its ranks."""
    from paddle_hsdp.comm import collectives as comm

    x = paddle.to_tensor([float(dist.get_rank())])
    comm.all_reduce(x, group)
    assert x.item() == float(sum(group.ranks)), (what, group.ranks, x.item())


def compare_with_reference(name: str, full: dict, ref_params: dict, losses, ref_losses,
                           worst: dict, limit: float | None = None) -> float:
    """Every parameter (same names, same shapes) and the losses within the parity bound
    (parity.py; ``limit`` overrides it); the worst differences are recorded in ``worst``
    (name -> max_rel) and reported as check ``name``. Returns the worst."""
    assert set(full) == set(ref_params), set(full) ^ set(ref_params)
    for key, value in full.items():
        assert list(value.shape) == list(ref_params[key].shape), key
        worst[key] = max_rel(value.numpy(), ref_params[key])
    worst["loss"] = max_rel(np.array(losses), np.array(ref_losses))
    return parity.report(name, worst, limit)


def train_loop(opt, steps, micro_loss, processes: int = 1, before_step=None, after_step=None):
    """One optimizer step per entry of ``steps`` (a list of micro-batches each):
    ``micro_loss(micro, index)`` is this process's loss of a micro-batch, backpropagated
    divided by the number of micro-batches. Returns each step's loss, the mean over its
    micro-batches and the ``processes`` training together (all-reduced for the log, not
    through paddle_hsdp). ``before_step(i)`` runs before ``opt.step()``,
    ``after_step(i)`` between it and ``opt.clear_grad()``."""
    losses = []
    for index, micro_batches in enumerate(steps):
        total = 0.0
        for m, micro in enumerate(micro_batches):
            loss = micro_loss(micro, m)
            (loss / len(micro_batches)).backward()
            value = float(loss)
            if processes > 1:
                t = paddle.to_tensor([value])
                dist.all_reduce(t)
                value = t.item() / processes
            total += value / len(micro_batches)
        if before_step is not None:
            before_step(index)
        opt.step()
        if after_step is not None:
            after_step(index)
        opt.clear_grad()
        losses.append(total)
    return losses


def assert_same_params(model, other) -> None:
    """Two models' full parameters (and buffers) are equal, name for name, bit for bit."""
    a, b = paddle_hsdp.full_state_dict(model), paddle_hsdp.full_state_dict(other)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        assert np.array_equal(a[name].numpy(), b[name].numpy()), name
