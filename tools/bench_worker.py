"""One benchmark variant on this process's rank (launched by tools/bench.py).

argv: JSON with variant (hsdp2x2, hsdp2x2_bf16, hsdp2x2_int8, hfsdp2x2, hfsdp2x2_int8, hsdp1x4,
dp, stage3, single), shape,
steps, per_rank (sequences per rank), world (ranks of the distributed variants), out
(where rank 0 writes its JSON result) and optionally two_hosts (launched by
tools/two_hosts.py: also measure what crosses between the hosts, see ``net_report``).
``hsdp2x2_bf16`` passes ``MixedPrecisionPolicy(reduce_dtype="bfloat16")`` to every
``fully_shard`` call, ``*_int8`` ``MixedPrecisionPolicy(outer_compress="int8")`` (the outer
sync as blockwise int8 with error feedback, blocks of 256); ``hfsdp2x2`` is HSDP 2 x 2 with ``sharding_configs
["fsdp_outer_sharding"] = "optim"`` (the optimizer state sharded across the outer group
too). The paddle_hsdp variants also report the optimizer's state bytes on rank 0
(``memory_report(model, opt)["optimizer"]``, after the first step created them).

Every variant trains the same LlamaLike model (same seed) on the same token ids with
AdamW, no clipping; step times are rank 0's wall time per step after a barrier (the
first step, which allocates optimizer state, is timed but reported apart). Memory is
the training peak RSS per rank above the idle runtime: VmRSS before the model exists,
and VmHWM after training, with the peak mark reset (``/proc/self/clear_refs``) once
everything is set up.
"""

from __future__ import annotations

import json
import re
import os
import sys
import time

import numpy as np

import bench_model
import two_hosts  # (pure helpers; no namespaces are made here)

import paddle_hsdp  # noqa: F401  (before fleet.init)
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet


def vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: VmHWM then includes set-up


def batches(shape, steps, n_rows):
    rng = np.random.default_rng(7)
    return [rng.integers(0, shape.vocab, size=(n_rows, shape.seq + 1)).astype("int64")
            for _ in range(steps)]


def init(variant: str, world: int):
    if variant == "single":
        return 0, 1
    if is_engine(variant):
        outer = 2 if "2x2" in variant else 1
        sharding = {"fsdp_outer_degree": outer}
        if variant.startswith("hfsdp"):
            sharding["fsdp_outer_sharding"] = "optim"
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                                   "sharding_degree": world, "sharding_configs": sharding}
        fleet.init(is_collective=True, strategy=strategy)
    else:
        dist.init_parallel_env()
    return dist.get_rank(), dist.get_world_size()


def is_engine(variant: str) -> bool:
    """A paddle_hsdp variant (HSDP or HFSDP)."""
    return variant.startswith(("hsdp", "hfsdp"))


def wrap(variant: str, model):
    """The model and optimizer of a variant, after everything that shards or wraps."""
    def adamw(params):
        return paddle.optimizer.AdamW(learning_rate=1e-3, parameters=params)

    if is_engine(variant):
        policy = None
        if variant.endswith("_bf16"):
            policy = paddle_hsdp.MixedPrecisionPolicy(reduce_dtype="bfloat16")
        elif variant.endswith("_int8"):  # the outer sync as blockwise int8 (issue 66)
            policy = paddle_hsdp.MixedPrecisionPolicy(outer_compress="int8")
        kwargs = {"mp_policy": policy}
        every = re.search(r"_diloco(\d+)", variant)
        if every:  # DiLoCo: the replicas sync every H steps (engine/diloco.py)
            fragments = re.search(r"_f(\d+)$", variant)  # streaming: F fragments in turn
            kwargs["outer_sync_policy"] = paddle_hsdp.OuterSyncPolicy(
                every=int(every[1]), fragments=int(fragments[1]) if fragments else 1)
        if "_muon" in variant:  # Muon: its matrices owned by one rank, or whole on all
            kwargs["shard_placement_fn"] = muon_placement(model, variant)
        for layer in model.layers:
            paddle_hsdp.fully_shard(layer, **kwargs)
        paddle_hsdp.fully_shard(model, **kwargs)
        if "_muon" in variant:  # one map for the placement and the optimizer
            return model, paddle_hsdp.Muon(learning_rate=0.02, parameters=model.parameters(),
                                           weight_decay=0.0,
                                           muon_param_info_map=muon_info(model))
        return model, adamw(model.parameters())
    if variant == "dp":
        return paddle.DataParallel(model), adamw(model.parameters())
    if variant == "stage3":
        return stage3(model, adamw(model.parameters()))
    return model, adamw(model.parameters())


def muon_info(model):
    """Which parameters Muon updates, by structured name (lm_head, embed_tokens: AdamW):
    the placement and the optimizer are given the same map."""
    from paddle_hsdp.optim.muon import muon_param_info
    return muon_param_info(model)


def muon_placement(model, variant: str):
    """``*_muon``: owned_matrices(); ``*_muon_replicate``: the same matrices kept whole on
    every rank (Replicate()), Muon's memory without owners."""
    owned = paddle_hsdp.owned_matrices(info=muon_info(model))
    if variant.endswith("_muon"):
        return owned
    return lambda p: dist.Replicate() if owned(p) is not None else None


def ns_flops_report(model, opt, mine: int, world: int) -> dict | None:
    """The last step's Newton-Schulz flops (Muon's own counter): the largest rank's and
    every rank's together, against the model's (each matrix it updates whole, once).
    None on a --baseline engine without the counter."""
    try:
        from paddle_hsdp.optim.muon import newton_schulz_flops
    except ImportError:
        return None
    per_rank = [mine]
    if world > 1:
        gathered = []
        dist.all_gather(gathered, paddle.to_tensor([mine], dtype="int64"))
        per_rank = [int(x.item()) for x in gathered]
    model_flops = sum(newton_schulz_flops(sorted(p._hsdp_sharded_param.shape), opt._ns_steps)
                      for p in model.parameters() if hasattr(p, "_hsdp_sharded_param")
                      and not p.stop_gradient and len(p._hsdp_sharded_param.shape) == 2
                      and opt.updates_as_matrix(p))
    return {"max_rank": max(per_rank), "all_ranks": sum(per_rank), "model": model_flops}


def owner_imbalance(units) -> float | None:
    """The largest owner imbalance over the units' buffers (owned elements per segment,
    max over mean), None without owners."""
    from paddle_hsdp.engine.layout import owner_balance
    values = [owner_balance(buf.layout)["imbalance"] for unit in units for buf in unit.buffers
              if any(buf.layout.owned) and buf.layout.segments > 1]
    return max(values) if values else None


def stage3(model, opt):
    """Paddle's GroupShardedStage3 on CPU: its constructor asserts a CUDA build, but the
    class runs with device="cpu" when that check is bypassed during construction.
    segment_size=0 shards every parameter, as paddle_hsdp does."""
    from paddle.base import core
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import (
        GroupShardedStage3,
    )

    original = core.is_compiled_with_cuda
    core.is_compiled_with_cuda = lambda: True
    try:
        wrapped = GroupShardedStage3(model, opt, device="cpu", segment_size=0)
    finally:
        core.is_compiled_with_cuda = original
    return wrapped, wrapped._optim


def theoretical_comm(units, inner: int, outer: int) -> dict:
    """Per-step wire bytes per rank from the volume formulas (docs/architecture.md), unpadded (one micro-step)."""
    gather = reduce = outer_sync = compressed = 0.0
    for unit in units:
        for buf in unit.buffers:
            nbytes = buf.logical_numel * buf.shape().master_bytes
            times = 2 if unit.should_reshard_after_forward() else 1
            gather += times * (inner - 1) / inner * nbytes
            if buf.trainable and getattr(unit, "outer_sync", None) is not None:
                # DiLoCo: every H steps the pseudo-gradient's reduce-scatter (in the
                # params' dtype, or int8's all-gather of every replica's codes) and an
                # all-gather of the new params
                every = unit.outer_sync.policy.every
                reduce += buf.logical_numel * buf.shape().reduce_bytes
                outer_sync += nbytes / every
                if getattr(buf.pieces, "compress", None):
                    n = buf.logical_numel / inner
                    compressed += (outer - 1) * (n + 4 * n / buf.pieces.compress_block) / every
                else:
                    outer_sync += nbytes / every
            elif buf.trainable and getattr(buf.pieces, "compress", None):
                # int8 outer sync: an all-gather of every replica's codes of the shard
                # (n / inner values) and one float32 scale per block, (O - 1) of them
                # per rank; HFSDP's rebuild all-gather as below
                reduce += buf.logical_numel * buf.shape().reduce_bytes
                n = buf.logical_numel / inner
                compressed += (outer - 1) * (n + 4 * n / buf.pieces.compress_block)
                if getattr(buf, "parts", 1) > 1:
                    outer_sync += buf.logical_numel * buf.shape().master_bytes
            elif buf.trainable:  # reduce-scatter and outer all-reduce travel in reduce_dtype
                numel = buf.logical_numel * buf.shape().reduce_bytes
                reduce += numel
                # HFSDP: the outer all-reduce is a reduce-scatter (reduce_dtype) and an
                # all-gather (the params' own dtype)
                outer_sync += (numel + (buf.logical_numel * buf.shape().master_bytes
                                        if getattr(buf, "parts", 1) > 1 else numel))
    return {"inner all_gather": gather,
            "inner reduce_scatter": (inner - 1) / inner * reduce,
            "outer all_reduce": (outer - 1) / outer * outer_sync / inner + compressed}


def measured_comm() -> dict:
    """Per-step wire bytes per group kind; "outer all_reduce" is the step's outer sync
    (with HFSDP its reduce-scatter and all-gather)."""
    c = paddle_hsdp.comm.counter
    return {"inner all_gather": c.get("inner", "all_gather").wire_bytes,
            "inner reduce_scatter": c.get("inner", "reduce_scatter").wire_bytes,
            "outer all_reduce": sum(c.get("outer", op).wire_bytes for op in
                                    ("all_reduce", "reduce_scatter", "all_gather",
                                     "all_reduce_int8", "all_reduce_fp8"))}


# ---------------------------------------------------------------- two hosts


def host_of_ranks() -> dict[int, str]:
    """Each rank's host address, from the launcher's endpoint list (in rank order)."""
    endpoints = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")
    return {i: ep.rsplit(":", 1)[0] for i, ep in enumerate(endpoints) if ep}


def net_counters() -> list[int]:
    """This host's cross-host link counters: [bytes, frames] through its veth (the
    device gloo uses; inside the host's namespace /sys shows its own) in both
    directions, then the host's TCP retransmitted segments and retransmission timeouts
    (each a stall of at least 200 ms)."""
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    stats = {}
    for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
        with open(f"/sys/class/net/{dev}/statistics/{key}") as f:
            stats[key] = int(f.read())
    return [stats["tx_bytes"] + stats["rx_bytes"], stats["tx_packets"] + stats["rx_packets"],
            proc_net_counter("snmp", "Tcp:", "RetransSegs"),
            proc_net_counter("netstat", "TcpExt:", "TCPTimeouts")]


def proc_net_counter(table: str, prefix: str, name: str) -> int:
    """One counter of /proc/net/snmp or /proc/net/netstat (this network namespace's)."""
    with open(f"/proc/net/{table}") as f:
        head, values = [line.split() for line in f if line.startswith(prefix)][:2]
    return int(values[head.index(name)])


def groups_by_label(units) -> dict:
    """The counter's group labels and the groups behind them (inner and outer)."""
    return {paddle_hsdp.comm.group_label(g): g
            for u in units for b in u.buffers for g in (b.inner, b.outer)}


def counter_cross_bytes(snapshot: dict, groups: dict, rank: int, hosts: dict) -> list:
    """Bytes this rank sent across hosts in one step, from the counter, two ways: [ring]
    every op a ring in group order (a group's bytes cross when the rank's successor is on
    the other host); [gloo] the same, except reduce-scatters on gloo as paddle_hsdp makes
    them there (a gloo reduce per owner's slice, see two_hosts)."""
    ring = gloo = 0.0
    for (label, op), stats in snapshot.items():
        if label not in groups:
            continue
        ranks = groups[label].ranks
        as_ring = two_hosts.ring_cross_bytes(stats.wire_bytes, ranks, rank, hosts)
        ring += as_ring
        gloo += two_hosts.gloo_reduce_scatter_cross_bytes(stats.payload_bytes, ranks, rank,
                                                          hosts) \
            if op == "reduce_scatter" and paddle_hsdp.comm.is_gloo(groups[label]) else as_ring
    return [ring, gloo]


def paddle_wire_bytes(variant: str, model, world: int) -> float:
    """Per-rank ring bytes of one step of Paddle's own collectives (paddle_hsdp's counter
    does not see them), from the model's sizes: DataParallel all-reduces every float32
    grad once; stage 3 all-gathers every parameter's (aligned, padded) buffer in forward
    and again in backward, and all-reduces its full-size grad once."""
    ring = (world - 1) / world
    if variant == "dp":
        return 2 * ring * sum(int(p.numel()) * p.element_size() for p in model.parameters())
    return (2 * ring + 2 * ring) * 4 * sum(model._param2buffer_size.values())


def net_report(start: list[int], end: list[int], cross_sent: list, steps: int) -> dict:
    """What crossed in the timed window (steps after the first), from every rank's
    figures: the veth counters of host 0 (rank 0 reads its host's; both ends see every
    frame), TCP retransmissions and timeouts per host, and the sum of the ranks' expected
    crossing bytes."""
    world, hosts = dist.get_world_size(), host_of_ranks()
    mine = paddle.to_tensor([e - s for s, e in zip(start, end)] + cross_sent, "float64")
    gathered = []
    dist.all_gather(gathered, mine)
    rows = [[int(x) for x in t.numpy()[:4]] + [float(x) for x in t.numpy()[4:]]
            for t in gathered]
    first_of_host = {}
    for r in range(world):
        first_of_host.setdefault(hosts[r], r)
    return {"window_steps": steps, "hosts_of_ranks": [hosts[r] for r in range(world)],
            "veth_bytes": rows[0][0], "veth_frames": rows[0][1],
            "veth_payload_bytes": two_hosts.payload_bytes(rows[0][0], rows[0][1]),
            "retrans_segs_per_host": {h: rows[r][2] for h, r in first_of_host.items()},
            "rto_timeouts_per_host": {h: rows[r][3] for h, r in first_of_host.items()},
            "expected_cross_bytes": sum(row[4] for row in rows),
            "expected_cross_bytes_gloo": sum(row[5] for row in rows)}


def memory_timeline(rank: int, variant: str):
    """paddle_hsdp's memory timeline (engine/trace.py), on rank 0 of a paddle_hsdp
    variant run with an engine that has one (a --baseline engine may not): else None."""
    engine = getattr(paddle_hsdp, "engine", None)
    trace = getattr(engine, "trace", None) if engine is not None else None
    if rank != 0 or not is_engine(variant) or not hasattr(trace, "recording_memory"):
        return None
    return trace


def timeline_columns(rows: list, idle_bytes: int) -> dict:
    """The timeline as columns (t from the first row, bytes as they are), and the idle
    RSS the benchmark's peak is measured above."""
    keys = [k for k in rows[0] if k not in ("t", "event", "unit")] if rows else []
    t0 = rows[0]["t"] if rows else 0.0
    return {"t": [r["t"] - t0 for r in rows], "event": [r["event"] for r in rows],
            "unit": [r["unit"] for r in rows], "idle_rss": idle_bytes,
            "bytes": {k: [r.get(k, 0) for r in rows] for k in keys}}


def units_under(model) -> list:
    """The engine's units under ``model``. A --baseline engine from before the
    sub-packages (issue 17) keeps them in ``paddle_hsdp.api``."""
    engine = getattr(paddle_hsdp, "engine", None)
    if engine is not None:
        return engine.registry.units_under(model)
    return paddle_hsdp.api._units_under(model)


def main():
    cfg = json.loads(sys.argv[1])
    variant, shape = cfg["variant"], bench_model.SHAPES[cfg["shape"]]
    rank, world = init(variant, cfg["world"])
    n_rows = cfg["per_rank"] * cfg["world"]
    data = batches(shape, cfg["steps"], n_rows)
    idle_kb = vm_kb("VmRSS")
    model, opt = wrap(variant, bench_model.build(shape))
    units = units_under(model) if is_engine(variant) else []
    rows = slice(None) if variant == "single" else slice(rank * cfg["per_rank"],
                                                         (rank + 1) * cfg["per_rank"])
    two_host = bool(cfg.get("two_hosts")) and world > 1 and cfg["steps"] > 1
    hosts = host_of_ranks() if two_host else {}
    groups = groups_by_label(units)
    paddle_step = paddle_wire_bytes(variant, model, world) if two_host and not units else 0.0
    cross_sent, net_start = [0.0, 0.0], None
    reset_peak_rss()
    trace = memory_timeline(rank, variant)
    if trace is not None:  # from shapes, no device reads: cheap enough to stay on
        trace.enable(memory=True, rss=True)
    times, losses, comm_steps = [], [], []
    ns_before = ns_last = 0
    for step, ids in enumerate(data):
        if world > 1:
            dist.barrier()
        if trace is not None:
            trace.record("bench", "step", step)
        if two_host and step == 1:  # step 0 is done everywhere: the timed window opens
            net_start = net_counters()
        paddle_hsdp.comm.counter.reset()
        start = time.perf_counter()
        loss = bench_model.loss_of(model, paddle.to_tensor(ids[rows]))
        loss.backward()
        ns_before = getattr(opt, "ns_flops", 0)
        opt.step()
        ns_last = getattr(opt, "ns_flops", 0) - ns_before  # this rank's Newton-Schulz
        opt.clear_grad()
        times.append(time.perf_counter() - start)
        comm_steps.append(measured_comm())
        if step == 0 and units:  # the first step created the optimizer's state
            try:
                optimizer_bytes = paddle_hsdp.memory_report(model, opt).get("optimizer")
            except TypeError:  # a --baseline engine older than memory_report(model, opt)
                optimizer_bytes = None
        if two_host and step >= 1:
            sent = counter_cross_bytes(paddle_hsdp.comm.counter.snapshot(), groups, rank,
                                       hosts) if units else \
                [two_hosts.ring_cross_bytes(paddle_step, list(range(world)), rank, hosts)] * 2
            cross_sent = [a + b for a, b in zip(cross_sent, sent)]
        t = paddle.to_tensor([float(loss)])
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    timeline = None
    if trace is not None:
        trace.disable()
        # (an engine before trace.recorded(), e.g. a --baseline, kept it on the module)
        recorded = trace.recorded() if hasattr(trace, "recorded") else trace
        timeline = timeline_columns(list(recorded.timeline), idle_kb * 1024)
    net = None
    if two_host:
        dist.barrier()  # every rank's last step is done: the window closes
        net = net_report(net_start, net_counters(), cross_sent, len(data) - 1)
    peak_kb = vm_kb("VmHWM") - idle_kb
    peaks = [peak_kb]
    if world > 1:
        gathered = []
        dist.all_gather(gathered, paddle.to_tensor([peak_kb], dtype="int64"))
        peaks = [int(x.item()) for x in gathered]
    result = {"variant": variant, "shape": cfg["shape"], "params": shape.params(),
              "world": world, "step_times": times, "losses": losses,
              "peak_rss_mb": [p / 1024 for p in peaks]}
    if units:
        inner = units[0].buffers[0].inner.nranks
        outer = units[0].buffers[0].outer.nranks
        result["layout"] = [outer, inner]
        result["comm_measured"] = comm_steps[-1]
        result["comm_theoretical"] = theoretical_comm(units, inner, outer)
        result["units"] = [sum(b.logical_numel for b in u.buffers) for u in units]
        result["optimizer_bytes"] = optimizer_bytes  # None: a --baseline engine
        if variant.endswith("_muon"):
            result["owner_imbalance"] = owner_imbalance(units)
            result["ns_flops"] = ns_flops_report(model, opt, ns_last, world)
    if timeline is not None:
        result["timeline"] = timeline
    if net:
        net["expected_basis"] = "paddle_hsdp.comm.counter" if units else \
            "ring formula from the model's sizes (Paddle's collectives are not counted)"
        net["engine"] = os.path.dirname(os.path.dirname(paddle_hsdp.__file__))
        result["two_hosts"] = net
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(result, f)
    if world > 1:
        dist.barrier()


if __name__ == "__main__":
    if os.environ.get("HSDP_BENCH_PROFILE"):  # cProfile of rank 0, for reading hot spots
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(main)
        if os.environ.get("PADDLE_TRAINER_ID", "0") == "0":
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    else:
        main()
