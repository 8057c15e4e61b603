"""Which ``fsdp_outer_degree`` for a cluster: predicted communication time and memory per
rank of every feasible layout, and a recommendation that says why.

Bytes come from :mod:`paddle_hsdp.topology.cost` (the formulas the communication counter is held
to); time is an alpha-beta model per collective with ring algorithms:

* a ring over ``n`` ranks: all-gather / reduce-scatter take ``(n - 1)`` latency steps and
  move ``(n - 1) / n`` of the payload per rank; all-reduce twice both;
* a group inside one machine runs on the intra-node link; a group that spans machines is
  bound by the inter-node link, which carries one ring edge per machine, times the
  number of such rings that run at once through the same machine (the outer groups of
  every inner position run concurrently: ``min(inner, ranks per node)`` of them);
* groups are contiguous rank blocks as fleet builds them (inner groups first), so an
  inner group of at most ``ranks_per_node`` ranks stays inside a machine;
* "exposed" communication is what compute does not hide: with
  ``overlap_intra_node`` (GPU clusters: prefetch runs a unit's intra-node all-gather and
  the previous unit's reduce-scatter under compute) only collectives on the inter-node
  link and the step's outer all-reduce count; without it (CPU/gloo, where nothing
  overlaps) everything counts. Hierarchical or tree algorithms, congestion and compute
  time itself are not modelled.

Memory per rank: shards, grads and AdamW state plus the peak of gathered parameters
(:func:`cost.memory_per_rank`); a layout "fits" when that leaves ``activation_fraction``
of the device memory for activations.

Every layout with outer degree > 1 can also run with ``fsdp_outer_sharding: optim``
(HFSDP, listed as its own row when asked for): AdamW state 1/O of HSDP's, the outer
all-reduce's time spent as an outer reduce-scatter plus an outer all-gather. At equal
time HSDP comes first, so HFSDP is recommended when it is what fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import yaml

from ..topology import cost
from . import layouts
from .schema import ConfigError

if TYPE_CHECKING:
    import os

    from .schema import HSDPConfig

_GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Link:
    """Alpha-beta: ``latency_s`` per ring step, ``bandwidth`` bytes per second.
    ``per_op``: optional fits of their own for some operations (``all_reduce``,
    ``all_gather``, ``reduce_scatter``, ``send``: point-to-point), as nccl-tests reports
    a bus bandwidth per collective: on CPU/gloo an all-reduce also sums on the CPU and
    runs at about half an all-gather's rate."""

    latency_s: float
    bandwidth: float
    per_op: tuple = ()  # ((op, Link), ...)

    def seconds(self, steps: int, nbytes: float) -> float:
        return steps * self.latency_s + nbytes / self.bandwidth

    def for_op(self, op: str) -> "Link":
        return dict(self.per_op).get(op, self)


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    device_memory_bytes: float
    overlap_intra_node: bool = True  # prefetch hides intra-node collectives behind compute
    backend: str = "nccl"  # "gloo": reduce-scatter is one reduce per slice ((1 + 1/n) x ring)
    achieved_tflops: float | None = None  # per device, at a realistic MFU: times the bubble

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


_CLUSTER_KEYS = {"name", "nodes", "ranks_per_node", "intra_node", "inter_node",
                 "device_memory_gib", "overlap_intra_node", "backend", "achieved_tflops"}
_LINK_KEYS = {"bandwidth_gbit", "latency_us"}
LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def _link(key: str, spec: object, errors: list, nested: bool = True) -> Link | None:
    """``{bandwidth_gbit, latency_us[, per_op: {op: {bandwidth_gbit, latency_us}}]}``."""
    per_op = spec.get("per_op", {}) if isinstance(spec, dict) and nested else {}
    plain = {k: v for k, v in spec.items() if k != "per_op"} if isinstance(spec, dict) \
        else spec
    if not isinstance(plain, dict) or set(plain) != _LINK_KEYS or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for v in plain.values()):
        errors.append(f"{key}: expected {{bandwidth_gbit: > 0, latency_us: > 0"
                      f"{', per_op: {...}' if nested else ''}}}, got {spec!r}")
        return None
    ops = []
    if not isinstance(per_op, dict):
        errors.append(f"{key}.per_op: expected {{op: {{bandwidth_gbit, latency_us}}}}, "
                      f"got {per_op!r}")
        per_op = {}
    for op, sub in per_op.items():
        if op not in LINK_OPS:
            errors.append(f"{key}.per_op: unknown operation {op!r} (valid: "
                          f"{', '.join(LINK_OPS)})")
            continue
        fitted = _link(f"{key}.per_op.{op}", sub, errors, nested=False)
        if fitted is not None:
            ops.append((op, fitted))
    return Link(plain["latency_us"] * 1e-6, plain["bandwidth_gbit"] * _GBIT, tuple(ops))


def load_cluster(source: str | os.PathLike | dict) -> Cluster:
    """A :class:`Cluster` from a YAML file or dict::

        name: 2 nodes x 8 GPUs, 100 Gbit/s
        nodes: 2
        ranks_per_node: 8
        intra_node: {bandwidth_gbit: 2400, latency_us: 5}
        inter_node: {bandwidth_gbit: 100, latency_us: 20}
        # optional, on either link: an operation's own fit (all_reduce, all_gather,
        # reduce_scatter, send)
        #   per_op: {all_reduce: {bandwidth_gbit: 80, latency_us: 25}}
        device_memory_gib: 80
        overlap_intra_node: true   # GPUs: prefetch hides them; false on CPU/gloo
        backend: nccl              # or gloo (its reduce-scatter moves more, see below)
        achieved_tflops: 400       # optional: dense bf16 per device at a realistic MFU,
                                   # times the pipeline bubble (config/layouts.py)
    """
    if not isinstance(source, dict):
        try:
            with open(source, encoding="utf-8") as f:
                source = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError([f"{source}: cannot read the cluster file ({e})"]) from None
    errors = [f"{k}: unknown cluster key (valid: {', '.join(sorted(_CLUSTER_KEYS))})"
              for k in source if k not in _CLUSTER_KEYS]
    for key in ("nodes", "ranks_per_node"):
        if not isinstance(source.get(key), int) or isinstance(source.get(key), bool) \
                or source[key] < 1:
            errors.append(f"{key}: expected an int >= 1, got {source.get(key)!r}")
    intra = _link("intra_node", source.get("intra_node"), errors)
    inter = _link("inter_node", source.get("inter_node"), errors)
    memory = source.get("device_memory_gib")
    if not isinstance(memory, (int, float)) or memory <= 0:
        errors.append(f"device_memory_gib: expected a number > 0, got {memory!r}")
    overlap = source.get("overlap_intra_node", True)
    if not isinstance(overlap, bool):
        errors.append(f"overlap_intra_node: expected true or false, got {overlap!r}")
    backend = source.get("backend", "nccl")
    if backend not in ("nccl", "gloo"):
        errors.append(f"backend: expected nccl or gloo, got {backend!r}")
    tflops = source.get("achieved_tflops")
    if tflops is not None and (not isinstance(tflops, (int, float)) or isinstance(tflops, bool)
                               or tflops <= 0):
        errors.append(f"achieved_tflops: expected a number > 0, got {tflops!r}")
    # (a link _link could not make, or a memory that is no number, has its error listed)
    if errors or intra is None or inter is None or not isinstance(memory, (int, float)):
        raise ConfigError(errors)
    return Cluster(str(source.get("name", "cluster")), source["nodes"],
                   source["ranks_per_node"], intra, inter, memory * 2.0 ** 30, overlap,
                   backend, tflops)


# ---------------------------------------------------------------- time
def _group_link(cluster: Cluster, members: int, stride: int) -> tuple[Link, int]:
    """The link a group of ``members`` ranks ``stride`` apart is bound by, and how many
    such rings cross each machine's link at once."""
    rpn = cluster.ranks_per_node
    if members == 1 or (members - 1) * stride < rpn and rpn % (members * stride) == 0:
        return cluster.intra, 1
    if stride == 1:
        return cluster.inter, 1  # one ring through whole machines
    return cluster.inter, min(stride, rpn)  # one ring per inner position, all at once


def collective_seconds(op: str, members: int, payload: float, link: Link,
                       concurrent: int = 1, backend: str = "nccl") -> float:
    """One ring collective of ``payload`` bytes over ``members`` ranks. On gloo,
    paddle_hsdp's reduce-scatter over more than two ranks is one reduce per owner's
    slice, measured on the two-host benchmark's link to move ``(1 + 1/n)`` times a
    ring's bytes (two ranks exchange slices by an all-gather: a ring's bytes)."""
    if members == 1:
        return 0.0
    factor = 2 if op == "all_reduce" else 1
    steps = factor * (members - 1)
    nbytes = concurrent * factor * (members - 1) / members * payload
    if op == "reduce_scatter" and backend == "gloo" and members > 2:
        nbytes *= 1 + 1 / members  # two ranks exchange their slices: a ring's bytes
    return link.for_op(op).seconds(steps, nbytes)


def step_seconds(units: list, cluster: Cluster, micro_steps: int = 1,
                 zero_stage: int | None = None, stride: int = 1) -> dict[str, float]:
    """Predicted seconds per optimizer step, per group kind, and ``exposed``: what is
    not hidden behind compute (everything, unless the cluster overlaps intra-node
    collectives; inter-node ones and the step's outer all-reduce always count).
    ``stride``: the rank distance inside an inner group (the tensor degree: fleet puts
    the mp ranks between them)."""
    # "outer all_reduce": the step's outer sync (with outer sub-shards its reduce-scatter
    # and all-gather: the same bytes and ring steps)
    out = {"inner all_gather": 0.0, "inner reduce_scatter": 0.0, "outer all_reduce": 0.0,
           "exposed": 0.0}

    def add(key: str, seconds: float, link: Link) -> None:
        out[key] += seconds
        if not (cluster.overlap_intra_node and link is cluster.intra and key != "outer all_reduce"):
            out["exposed"] += seconds

    for unit in units:
        gathers = 1 if zero_stage == 1 else micro_steps * (2 if unit.reshard_after_forward
                                                           else 1)
        reduces = 1 if zero_stage == 1 else micro_steps
        for b in unit.buffers:
            inner_link, inner_n = _group_link(cluster, b.inner, stride)
            outer_link, outer_n = _group_link(cluster, b.outer, b.inner * stride)
            gather = b.inner * b.shard_numel * b.gather_bytes
            tags = b.inner * cost.TAG_NUMEL * b.gather_bytes  # the check's own call
            add("inner all_gather", gathers * (
                collective_seconds("all_gather", b.inner, gather, inner_link, inner_n)
                + collective_seconds("all_gather", b.inner, tags, inner_link, inner_n)),
                inner_link)
            if b.trainable:
                add("inner reduce_scatter", reduces * collective_seconds(
                    "reduce_scatter", b.inner, b.inner * b.shard_numel * b.reduce_bytes,
                    inner_link, inner_n, cluster.backend), inner_link)
                add("outer all_reduce", _outer_seconds(b, outer_link, outer_n, cluster),
                    outer_link)
    return out


def _outer_seconds(b: cost.BufferShape, link: Link, concurrent: int,
                   cluster: Cluster) -> float:
    if b.outer_parts > 1:
        return (collective_seconds("reduce_scatter", b.outer, b.shard_numel * b.reduce_bytes,
                                   link, concurrent, cluster.backend)
                + collective_seconds("all_gather", b.outer, b.shard_numel * b.master_bytes,
                                     link, concurrent))
    return collective_seconds("all_reduce", b.outer, b.shard_numel * cost._outer_bytes(b),
                              link, concurrent)


# ---------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class ModelShape:
    """A decoder LM by its sizes (for models too large to build even lazily)."""

    layers: int
    hidden: int
    ffn: int
    vocab: int
    kv_heads_fraction: float = 1.0  # grouped-query attention: kv heads / heads
    tied: bool = False
    heads: int = 0  # attention heads (0: hidden / 128, the usual head size)
    fused: bool = False  # q/k/v and gate/up each one column-parallel layer (Megatron-LM)

    def __post_init__(self):
        if not self.heads:
            object.__setattr__(self, "heads", max(1, self.hidden // 128))

    @property
    def tp_collectives_per_layer(self) -> int:
        """Tensor-parallel all-reduces of a layer's activations per micro-batch: one in
        forward per row-parallel layer (o, down), one in backward per column-parallel
        layer's input (q, k, v, gate, up; fused: qkv, gate_up)."""
        return 4 if self.fused else 7

    def layer_params(self, tp: int = 1) -> int:
        """One decoder layer's parameters on one of ``tp`` tensor-parallel ranks (its
        matrices split, its two norms whole)."""
        h = self.hidden
        kv = int(h * self.kv_heads_fraction)
        return (2 * h * h + 2 * h * kv + 3 * h * self.ffn) // tp + 2 * h

    def embedding_params(self, tp: int = 1) -> int:
        return self.vocab * self.hidden // tp

    def head_params(self, tp: int = 1) -> int:
        """The output layer (none of its own when tied) and the final norm."""
        return (0 if self.tied else self.vocab * self.hidden // tp) + self.hidden

    def root_params(self, tp: int = 1, pp: int = 1) -> int:
        """What a stage holds beside its layers: embedding and head with one stage, the
        heavier of the two (first or last stage) with more."""
        if pp == 1:
            return self.embedding_params(tp) + self.head_params(tp)
        return max(self.embedding_params(tp), self.head_params(tp))

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


def parse_model_shape(text: str) -> ModelShape:
    """``layers=32,hidden=4096,ffn=11008,vocab=32000[,kv=0.25][,tied=1][,heads=32]
    [,fused=1]``."""
    names = {"layers": "layers", "hidden": "hidden", "ffn": "ffn", "vocab": "vocab",
             "kv": "kv_heads_fraction", "tied": "tied", "heads": "heads", "fused": "fused"}
    values: dict[str, Any] = {}  # ModelShape's keyword arguments
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key not in names or not value:
            raise ValueError(f"--model-shape: bad item {item!r}; expected "
                             f"{'=..,'.join(names)}=.. (layers, hidden, ffn, vocab required)")
        values[names[key]] = float(value) if key == "kv" else int(value)
    missing = [k for k in ("layers", "hidden", "ffn", "vocab") if k not in values]
    if missing:
        raise ValueError(f"--model-shape: missing {', '.join(missing)}")
    values["tied"] = bool(values.get("tied", 0))
    values["fused"] = bool(values.get("fused", 0))
    return ModelShape(**values)


def shape_units(shape: ModelShape, inner: int, outer: int, dtypes: dict,
                reshard_after_forward: bool = True, outer_sharding: str = "none",
                tp: int = 1, pp: int = 1) -> list:
    """One unit per decoder layer of the heaviest pipeline stage and a root (embedding,
    head, final norm; the heavier of the two with ``pp > 1``), each one buffer, of one
    of ``tp`` tensor-parallel ranks; per-parameter padding ignored (under one row per
    parameter)."""
    parts = outer if outer_sharding == "optim" else 1

    def unit(path: str, params: int, reshard: bool) -> cost.UnitShape:
        b = cost.BufferShape(shard_numel=math.ceil(params / inner / parts) * parts,
                             logical_numel=params, inner=inner, outer=outer, trainable=True,
                             outer_parts=parts, **dtypes)
        return cost.UnitShape(path, (b,), reshard, params)

    layers = [unit(f"layers.{i}", shape.layer_params(tp), reshard_after_forward)
              for i in range(shape.layers // pp)]
    return layers + [unit("<root>", shape.root_params(tp, pp), False)]


def dtype_bytes(config: HSDPConfig | None) -> dict:
    """Element sizes of a config's mixed precision (float32 masters)."""
    size = {"bf16": 2, "fp16": 2, "fp32": 4, None: 4}
    gather = size[getattr(config, "param_dtype", None)]
    reduce = size[getattr(config, "reduce_dtype", None)] if getattr(
        config, "reduce_dtype", None) else gather
    return {"master_bytes": 4, "gather_bytes": gather, "reduce_bytes": reduce,
            "compute_bytes": gather}


# ---------------------------------------------------------------- recommendation
@dataclass
class Option:
    outer: int
    inner: int
    label: str
    memory: dict
    seconds: dict
    fits: bool
    ranks_per_node: int = 1
    outer_sharding: str = "none"
    mp_degree: int = 1
    pp_degree: int = 1
    micro_steps: int = 1
    bubble: float = 0.0  # the pipeline's idle fraction of the step

    @property
    def comm_seconds(self) -> float:
        return sum(v for k, v in self.seconds.items() if k not in ("exposed", "bubble"))

    @property
    def exposed_seconds(self) -> float:
        """Communication compute does not hide, plus the pipeline bubble (idle time)."""
        return self.seconds["exposed"]

    @property
    def memory_total(self) -> float:
        return self.memory["params"] + self.memory["grads"] + self.memory["optimizer"] \
            + self.memory["peak_gathered"] + self.memory.get("activations", 0)

    @property
    def sharding_degree(self) -> int:
        return self.outer * self.inner

    def as_dict(self) -> dict:
        """The layout as fleet's degrees, with its memory and time (``plan --json``)."""
        gib = 2.0 ** 30
        return {"mp_degree": self.mp_degree, "pp_degree": self.pp_degree,
                "sharding_degree": self.sharding_degree, "fsdp_outer_degree": self.outer,
                "fsdp_outer_sharding": self.outer_sharding, "label": self.label,
                "gib_per_rank": round(self.memory_total / gib, 3),
                "exposed_ms": round(self.exposed_seconds * 1e3, 3), "fits": self.fits,
                "micro_steps": self.micro_steps, "bubble_fraction": round(self.bubble, 4),
                "memory_gib": {k: round(v / gib, 3) for k, v in self.memory.items()},
                "ms": {k: round(v * 1e3, 3) for k, v in self.seconds.items()}}


def evaluate(cluster: Cluster, units_for: Callable[..., list[cost.UnitShape]],
             micro_steps: int = 1, zero_stage: int | None = None,
             forward_prefetch: int = 1, activation_fraction: float = 0.3,
             outer_shardings: tuple = ("none",)) -> list[Option]:
    """Every ``outer`` dividing the world: ``units_for(outer, inner)`` gives the units
    (``units_for(outer, inner, "optim")`` those with outer sub-shards, for every
    ``outer > 1`` when ``outer_shardings`` names "optim"). Activations are not
    modelled: a layout fits when its state and gathered parameters leave
    ``activation_fraction`` of the device free (a model built from its factory;
    :func:`evaluate_layouts` models them for a model shape)."""
    options = []
    world = cluster.world
    for outer in [o for o in range(1, world + 1) if world % o == 0]:
        inner = world // outer
        modes = [m for m in outer_shardings if m == "none" or outer > 1] or ["none"]
        for mode in modes:
            units = units_for(outer, inner) if mode == "none" else units_for(outer, inner,
                                                                             mode)
            memory = cost.memory_per_rank(units, forward_prefetch)
            seconds = step_seconds(units, cluster, micro_steps, zero_stage)
            option = Option(outer, inner, _label(outer, inner, mode, 1, 1), memory, seconds,
                            False, cluster.ranks_per_node, mode, micro_steps=micro_steps)
            option.fits = option.memory_total <= (1 - activation_fraction) \
                * cluster.device_memory_bytes
            options.append(option)
    return options


def evaluate_layouts(cluster: Cluster, shape: ModelShape, work: layouts.Workload,
                     dtypes: dict, tps: Iterable[int] = (1,), pps: Iterable[int] = (1,),
                     micro_steps: int = 1, zero_stage: int | None = None,
                     reshard_after_forward: bool = True,
                     forward_prefetch: int = 1,
                     outer_shardings: tuple = ("none",)) -> list[Option]:
    """Every tensor degree of ``tps`` x pipeline degree of ``pps`` x outer degree x
    ``outer_shardings`` the cluster's world allows, for a model shape: HSDP's state and
    traffic (the heaviest stage's tensor-parallel slice), activations, tensor-parallel
    and pipeline traffic and the bubble (config/layouts.py). ``micro_steps``: the pure
    data-parallel layout's, which sets the global batch unless ``work.global_batch``
    does."""
    options = []
    for tp in tps:
        for pp in pps:
            if cluster.world % (tp * pp):
                continue
            data = cluster.world // (tp * pp)
            micro = work.micro_steps(data, micro_steps, cluster.world)
            for outer in layouts.divisors(data):
                inner = data // outer
                modes = [m for m in outer_shardings if m == "none" or outer > 1] or ["none"]
                for mode in modes:
                    units = shape_units(shape, inner, outer, dtypes, reshard_after_forward,
                                        mode, tp, pp)
                    options.append(_layout_option(cluster, shape, work, units, tp, pp, outer,
                                                  inner, mode, micro, zero_stage,
                                                  forward_prefetch))
    return options


def _layout_option(cluster: Cluster, shape: ModelShape, work: layouts.Workload,
                   units: list[cost.UnitShape], tp: int, pp: int, outer: int, inner: int,
                   mode: str, micro: int, zero_stage: int | None,
                   forward_prefetch: int) -> Option:
    memory: dict[str, float] = dict(cost.memory_per_rank(units, forward_prefetch))
    memory["activations"] = layouts.activation_bytes(shape, work, tp, pp, micro)
    seconds = step_seconds(units, cluster, micro, zero_stage, stride=tp)
    tp_link, tp_n = _group_link(cluster, tp, 1)
    seconds["tensor parallel"] = layouts.tp_calls(shape, tp, pp, micro) * collective_seconds(
        "all_reduce", tp, layouts.tp_payload(shape, work), tp_link, tp_n)
    pp_link, pp_n = _group_link(cluster, pp, inner * outer * tp)
    p2p = layouts.pp_bytes(shape, work, tp, pp, micro)
    seconds["pipeline p2p"] = pp_link.for_op("send").seconds(layouts.pp_messages(pp, micro),
                                                            pp_n * p2p)
    compute = layouts.compute_seconds(shape, work, tp, pp, micro, cluster.achieved_tflops)
    seconds["bubble"] = 0.0 if compute is None else compute * (pp - 1) / micro
    seconds["exposed"] += seconds["tensor parallel"] + seconds["pipeline p2p"] \
        + seconds["bubble"]
    option = Option(outer, inner, _label(outer, inner, mode, tp, pp), memory, seconds, False,
                    cluster.ranks_per_node, mode, tp, pp, micro,
                    layouts.bubble_fraction(pp, micro))
    option.fits = option.memory_total <= (1 - layouts.RESERVE) * cluster.device_memory_bytes
    return option


def _label(outer: int, inner: int, mode: str, tp: int, pp: int) -> str:
    if inner == 1:
        label = "ZeRO-1 (HFSDP)" if mode == "optim" else "DDP (no sharding)"
    elif outer == 1:
        label = "FSDP (pure)"
    else:
        label = "HFSDP" if mode == "optim" else "HSDP"
    split = "".join(f"{axis}{n} " for axis, n in (("TP", tp), ("PP", pp)) if n > 1)
    return split + label


def _ranks_per_node_of(options: list[Option]) -> int:
    return options[0].ranks_per_node if options else 1


def _where(o: Option) -> str:
    split = "".join(f"tp {n} x " for n in (o.mp_degree,) if n > 1) + \
        "".join(f"pp {n} x " for n in (o.pp_degree,) if n > 1)
    return f"{split}outer {o.outer} x inner {o.inner}"


def recommend(options: list[Option]) -> tuple[Option | None, str]:
    """The fitting option with the least exposed time per step (communication compute
    does not hide, and the pipeline bubble; ties: less communication, then fewer
    model-splitting ranks, then more sharding); the reason in words."""
    fitting = [o for o in options if o.fits]
    if not fitting:
        return None, ("no layout fits in device memory: shard more (tensor or pipeline "
                      "parallelism), offload, or use devices with more memory")

    def rank(o: Option) -> tuple:
        return (round(o.exposed_seconds, 6), round(o.comm_seconds, 6),
                o.mp_degree * o.pp_degree, -o.inner)

    runner = sorted(fitting, key=rank)
    best = runner[0]
    activations = best.memory.get("activations")
    held = "state + gathered params" + (" + activations" if activations is not None else "")
    why = (f"fits in memory ({best.memory_total / 2 ** 30:.1f} GiB of {held} per rank) "
           f"and has the least exposed communication{' and bubble' if best.pp_degree > 1 else ''}"
           f" per step ({best.exposed_seconds * 1e3:.1f} ms; {best.comm_seconds * 1e3:.1f} ms "
           "of communication in all")
    if len(runner) > 1:
        # another layout (the same layout's other fsdp_outer_sharding is in the table)
        second = next((o for o in runner if (o.outer, o.mp_degree, o.pp_degree)
                       != (best.outer, best.mp_degree, best.pp_degree)),
                      next(o for o in runner if o is not best))
        why += f"; next: {_where(second)} at {second.exposed_seconds * 1e3:.1f} ms exposed"
    rpn = _ranks_per_node_of(options)
    if best.mp_degree > 1:
        why += f"; tensor parallelism {best.mp_degree} stays inside a machine of {rpn}"
    if best.inner * best.mp_degree > rpn:
        why += ("; its shard group spans machines, so every all-gather crosses the slow "
                "link" + ("" if best.mp_degree > 1 or best.pp_degree > 1 else
                          ": tensor or pipeline parallelism inside a machine would let a "
                          "smaller shard group fit"))
    unfit = [o for o in options if not o.fits]
    if unfit:
        worst = unfit[-1]
        why += f"; {len(unfit)} layout(s) do not fit, e.g. {worst.label} " \
               f"({worst.memory_total / 2 ** 30:.1f} GiB)"
    return best, why + ")"


def recommendation_line(best: Option | None, why: str) -> str:
    if best is None:
        return f"recommended: none: {why}"
    split = "".join(f"{key}={n}, " for key, n in (("mp_degree", best.mp_degree),
                                                  ("pp_degree", best.pp_degree)) if n > 1)
    mode = f", fsdp_outer_sharding={best.outer_sharding}" \
        if best.outer_sharding != "none" else ""
    return (f"recommended: {split}fsdp_outer_degree={best.outer}{mode} "
            f"(inner {best.inner}): {why}")


def table(cluster: Cluster, options: list[Option], best: Option | None, why: str,
          title: str, top: int | None = None) -> str:
    """The layouts as a table (``top``: only that many fitting ones, least exposed
    first, and a line counting the rest), then the recommendation."""
    gib = 2.0 ** 30
    shown = options
    if top is not None:
        shown = sorted((o for o in options if o.fits), key=lambda o: o.exposed_seconds)[:top]
    split = any(o.mp_degree > 1 or o.pp_degree > 1 or "activations" in o.memory
                for o in options)
    tflops = f", {cluster.achieved_tflops:g} TFLOPS achieved per device" \
        if cluster.achieved_tflops else ""
    lines = [f"{title} on {cluster.name}: {cluster.nodes} nodes x {cluster.ranks_per_node} "
             f"ranks, intra {cluster.intra.bandwidth / _GBIT:g} Gbit/s "
             f"{cluster.intra.latency_s * 1e6:g} us, inter {cluster.inter.bandwidth / _GBIT:g} "
             f"Gbit/s {cluster.inter.latency_s * 1e6:g} us, "
             f"{cluster.device_memory_bytes / gib:g} GiB per device, intra-node "
             f"collectives {'hidden by prefetch' if cluster.overlap_intra_node else 'exposed'}"
             f"{tflops}", ""]
    head = (f"{'layout':<27s} {'tp':>3s} {'pp':>3s} " if split else f"{'layout':<18s} ") + \
        f"{'outer x inner':>13s} {'GiB/rank':>9s} {'fits':>5s} "
    if split:
        head += f"{'act GiB':>8s} {'micro':>6s} "
    head += f"{'inner AG ms':>11s} {'inner RS ms':>11s} {'outer AR ms':>11s} "
    if split:
        head += f"{'TP ms':>9s} {'PP p2p ms':>9s} {'bubble ms':>9s} "
    lines.append(head + f"{'comm ms':>9s} {'exposed ms':>10s}")
    for o in shown:
        s = o.seconds
        row = (f"{o.label:<27s} {o.mp_degree:>3d} {o.pp_degree:>3d} " if split
               else f"{o.label:<18s} ") + \
            f"{o.outer:>5d} x {o.inner:<5d} {o.memory_total / gib:>9.2f} " \
            f"{'yes' if o.fits else 'no':>5s} "
        if split:
            row += f"{o.memory.get('activations', 0) / gib:>8.2f} {o.micro_steps:>6d} "
        row += (f"{s['inner all_gather'] * 1e3:>11.1f} {s['inner reduce_scatter'] * 1e3:>11.1f} "
                f"{s['outer all_reduce'] * 1e3:>11.1f} ")
        if split:
            row += (f"{s.get('tensor parallel', 0) * 1e3:>9.1f} "
                    f"{s.get('pipeline p2p', 0) * 1e3:>9.1f} {s.get('bubble', 0) * 1e3:>9.1f} ")
        mark = " <- recommended" if o is best else ""
        lines.append(row + f"{o.comm_seconds * 1e3:>9.1f} {o.exposed_seconds * 1e3:>10.1f}{mark}")
    if len(shown) < len(options):
        lines.append(f"({len(options) - len(shown)} more layouts, "
                     f"{sum(not o.fits for o in options)} of them not fitting; --json lists all)")
    return "\n".join(lines + ["", recommendation_line(best, why)])


def as_json(cluster: Cluster, options: list[Option], best: Option | None, why: str,
            title: str) -> dict:
    """What ``plan --json`` prints: ``recommended`` (a layout, or None) and ``layouts``."""
    return {"model": title, "cluster": cluster.name, "world_size": cluster.world,
            "ranks_per_node": cluster.ranks_per_node,
            "recommended": best.as_dict() if best is not None else None, "why": why,
            "layouts": [o.as_dict() for o in options]}
