"""Shared set-up for the multi-process workers."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import parity
from parity import max_rel  # noqa: F401  (the workers' one relative-difference measure)

import paddle_hsdp  # must precede fleet.init
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology as fleet_topology
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.topology.fleet import SEPARATE_REDUCE_SCATTER_ENV

MOE_ORDER = ["dp", "pp", "moe_sharding", "ep", "sharding", "sep", "cp", "mp"]


# (layout, HCG) of each fleet.init init_fleet ran in this process, in order (run_many.py)
_built_here: list = []


def init_fleet(config: dict):
    """``config``: hybrid degrees, ``outer`` (fsdp_outer_degree), ``outer_sharding``
    (fsdp_outer_sharding, default "none"), ``separate_reduce_scatter`` (fleet.init with
    PADDLE_HSDP_SEPARATE_REDUCE_SCATTER=1: the inner groups' reduce-scatter twins NCCL
    gets, forced on gloo for this layout only), ``pipeline_configs`` (the strategy's,
    read by ``fleet.distributed_model`` for a pipeline), ``check_typo`` (first
    show that a misspelt option is refused before any group exists). Every launch then
    checks the HSDP and HCG groups of its layout (:func:`check_groups`). Several workers
    in one launch (run_many.py) share one fleet.init per layout: the layout of the last
    fleet.init again returns its HCG (if it is still the live one); another layout, or
    an HCG another worker's own fleet.init made (apply_config's), runs fleet.init again,
    which builds a new HCG and all of its groups (and HSDP's) after the earlier ones, on
    every rank alike, and checks them as a first fleet.init would (the earlier groups
    stay, unused)."""
    layout = {k: v for k, v in config.items()
              if k.endswith("_degree")
              or k in ("outer", "outer_sharding", "separate_reduce_scatter",
                       "pipeline_configs")}
    previous = fleet_topology._HYBRID_PARALLEL_GROUP
    if previous is not None:
        if _built_here and _built_here[-1][0] == layout and _built_here[-1][1] is previous:
            return previous
        assert not config.get("check_typo"), "check_typo needs the launch's first fleet.init"
        # fleet.init keeps an existing HCG: forget it, so it builds this layout's
        fleet_topology._HYBRID_PARALLEL_GROUP = None
    strategy = fleet.DistributedStrategy()
    hybrid = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    hybrid.update({k: v for k, v in config.items() if k.endswith("_degree")})
    if config.get("check_typo"):
        refuse_misspelt_option(strategy, hybrid)
    hybrid["sharding_configs"] = {"fsdp_outer_degree": config.get("outer", 1)}
    if "outer_sharding" in config:
        hybrid["sharding_configs"]["fsdp_outer_sharding"] = config["outer_sharding"]
    if hybrid.get("ep_degree", 1) > 1:
        strategy.hybrid_parallel_order = MOE_ORDER
    strategy.hybrid_configs = hybrid
    if "pipeline_configs" in config:
        strategy.pipeline_configs = config["pipeline_configs"]
    twins = {SEPARATE_REDUCE_SCATTER_ENV: "1"} if config.get("separate_reduce_scatter") else {}
    saved = {k: os.environ.get(k) for k in twins}
    os.environ.update(twins)
    try:
        fleet.init(is_collective=True, strategy=strategy)
    finally:  # read when fleet.init builds the groups: the next layout gets its own
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    hcg = fleet.get_hybrid_communicate_group()
    assert hcg is fleet_topology._HYBRID_PARALLEL_GROUP and hcg is not previous  # a new HCG
    _built_here.append((layout, hcg))
    check_groups(hcg, config)
    return hcg


def refuse_misspelt_option(strategy, hybrid: dict) -> None:
    """``fsdp_outer_degre`` (one letter short) is refused on this rank, naming the right
    key, while no process group exists yet (nothing could hang)."""
    from paddle.distributed import collective

    try:
        strategy.hybrid_configs = dict(hybrid, sharding_configs={"fsdp_outer_degre": 2})
    except ValueError as e:
        assert "did you mean 'fsdp_outer_degree'?" in str(e), e
    else:
        raise AssertionError("a misspelt sharding_configs key was accepted")
    assert not collective._group_map, collective._group_map  # refused before any group
    print(f"rank {dist.get_rank()} refused the misspelt option before any group", flush=True)


def check_groups(hcg, config: dict) -> None:
    """Every HSDP group (and every Paddle HCG group) of this layout has the right members
    and works: the [outer, inner] reshape of the FSDP group, row-major, from first
    principles, and an all-reduce of the ranks on each."""
    rank, outer = dist.get_rank(), config.get("outer", 1)
    assert hcg.get_fsdp_outer_degree() == outer
    assert hcg.get_fsdp_outer_sharding() == config.get("outer_sharding", "none")
    for is_expert in (False, True):
        what = "expert" if is_expert else "dense"
        fsdp = hcg.get_fsdp_group(is_expert)
        inner = hcg.get_fsdp_inner_group(is_expert)
        outer_g = hcg.get_fsdp_outer_group(is_expert)
        expected_fsdp = (hcg.get_moe_sharding_parallel_group() if config.get("ep_degree", 1) > 1
                         and is_expert else hcg.get_sharding_parallel_group())
        assert fsdp.ranks == expected_fsdp.ranks, (what, fsdp.ranks)
        n_inner = len(fsdp.ranks) // outer
        idx = fsdp.ranks.index(rank)
        assert inner.ranks == fsdp.ranks[(idx // n_inner) * n_inner:(idx // n_inner + 1) * n_inner]
        assert outer_g.ranks == fsdp.ranks[idx % n_inner::n_inner], (what, outer_g.ranks)
        for group, kind in ((fsdp, "fsdp"), (inner, "inner"), (outer_g, "outer")):
            if group.nranks > 1:
                rank_sum_check(group, f"{what} {kind}")
        print(f"rank {rank} {what}: fsdp {fsdp.ranks} inner {inner.ranks} outer {outer_g.ranks}")
    # Dense and expert outer groups with the same ranks are one communicator.
    d, e = hcg.get_fsdp_outer_group(False), hcg.get_fsdp_outer_group(True)
    assert (d is e) == (d.ranks == e.ranks), (d.ranks, e.ranks)
    # Paddle's own HCG groups were created through the safe path too: they must work.
    own = {"dp": hcg.get_data_parallel_group(), "mp": hcg.get_model_parallel_group(),
           "pp": hcg.get_pipe_parallel_group(), "sharding": hcg.get_sharding_parallel_group()}
    if config.get("ep_degree", 1) > 1:
        own["ep"] = hcg.get_expert_parallel_group()
        own["moe_sharding"] = hcg.get_moe_sharding_parallel_group()
    for name, group in own.items():
        if group.nranks > 1:
            rank_sum_check(group, name)


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


def report_over(group, name: str, worst: dict) -> float:
    """Check ``name`` here (this rank's ``worst``, entry -> max_rel, within the bound of
    the default dtype, failing with the entries over it) and report the worst of every
    rank of ``group`` as one check, so that rank 0's log (the one the launcher reads)
    holds the figure of the ranks whose parameters it does not see (other pipeline
    stages, other tensor-parallel slices)."""
    bad = {k: v for k, v in worst.items() if not v <= parity.bound()}
    assert not bad, f"{name}: parity failed on rank {dist.get_rank()}: {bad}"
    values = np.zeros([group.nranks])
    values[group.rank] = max(worst.values())
    t = paddle.to_tensor(values, dtype="float64")
    comm.all_reduce(t, group, tag="log")
    return parity.report(name, {f"rank {r}": v for r, v in zip(group.ranks, t.tolist())})


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
