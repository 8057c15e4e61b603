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

import yaml

from ..topology import cost
from .schema import ConfigError

_GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Link:
    """Alpha-beta: ``latency_s`` per ring step, ``bandwidth`` bytes per second."""

    latency_s: float
    bandwidth: float

    def seconds(self, steps: int, nbytes: float) -> float:
        return steps * self.latency_s + nbytes / self.bandwidth


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

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


_CLUSTER_KEYS = {"name", "nodes", "ranks_per_node", "intra_node", "inter_node",
                 "device_memory_gib", "overlap_intra_node", "backend"}
_LINK_KEYS = {"bandwidth_gbit", "latency_us"}


def load_cluster(source) -> Cluster:
    """A :class:`Cluster` from a YAML file or dict::

        name: 2 nodes x 8 GPUs, 100 Gbit/s
        nodes: 2
        ranks_per_node: 8
        intra_node: {bandwidth_gbit: 2400, latency_us: 5}
        inter_node: {bandwidth_gbit: 100, latency_us: 20}
        device_memory_gib: 80
        overlap_intra_node: true   # GPUs: prefetch hides them; false on CPU/gloo
        backend: nccl              # or gloo (its reduce-scatter moves more, see below)
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
    links = {}
    for key in ("intra_node", "inter_node"):
        spec = source.get(key)
        if not isinstance(spec, dict) or set(spec) != _LINK_KEYS or not all(
                isinstance(v, (int, float)) and v > 0 for v in spec.values()):
            errors.append(f"{key}: expected {{bandwidth_gbit: > 0, latency_us: > 0}}, "
                          f"got {spec!r}")
            continue
        links[key] = Link(spec["latency_us"] * 1e-6, spec["bandwidth_gbit"] * _GBIT)
    memory = source.get("device_memory_gib")
    if not isinstance(memory, (int, float)) or memory <= 0:
        errors.append(f"device_memory_gib: expected a number > 0, got {memory!r}")
    overlap = source.get("overlap_intra_node", True)
    if not isinstance(overlap, bool):
        errors.append(f"overlap_intra_node: expected true or false, got {overlap!r}")
    backend = source.get("backend", "nccl")
    if backend not in ("nccl", "gloo"):
        errors.append(f"backend: expected nccl or gloo, got {backend!r}")
    if errors:
        raise ConfigError(errors)
    return Cluster(str(source.get("name", "cluster")), source["nodes"],
                   source["ranks_per_node"], links["intra_node"], links["inter_node"],
                   memory * 2.0 ** 30, overlap, backend)


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
    return link.seconds(steps, nbytes)


def step_seconds(units: list, cluster: Cluster, micro_steps: int = 1,
                 zero_stage: int | None = None) -> dict[str, float]:
    """Predicted seconds per optimizer step, per group kind, and ``exposed``: what is
    not hidden behind compute (everything, unless the cluster overlaps intra-node
    collectives; inter-node ones and the step's outer all-reduce always count)."""
    # "outer all_reduce": the step's outer sync (with outer sub-shards its reduce-scatter
    # and all-gather: the same bytes and ring steps)
    out = {"inner all_gather": 0.0, "inner reduce_scatter": 0.0, "outer all_reduce": 0.0,
           "exposed": 0.0}

    def add(key, seconds, link):
        out[key] += seconds
        if not (cluster.overlap_intra_node and link is cluster.intra and key != "outer all_reduce"):
            out["exposed"] += seconds

    for unit in units:
        gathers = 1 if zero_stage == 1 else micro_steps * (2 if unit.reshard_after_forward
                                                           else 1)
        reduces = 1 if zero_stage == 1 else micro_steps
        for b in unit.buffers:
            inner_link, inner_n = _group_link(cluster, b.inner, 1)
            outer_link, outer_n = _group_link(cluster, b.outer, b.inner)
            gather = b.inner * (b.shard_numel + cost.TAG_NUMEL) * b.gather_bytes
            add("inner all_gather", gathers * collective_seconds(
                "all_gather", b.inner, gather, inner_link, inner_n), inner_link)
            if b.trainable:
                add("inner reduce_scatter", reduces * collective_seconds(
                    "reduce_scatter", b.inner, b.inner * b.shard_numel * b.reduce_bytes,
                    inner_link, inner_n, cluster.backend), inner_link)
                add("outer all_reduce", _outer_seconds(b, outer_link, outer_n, cluster),
                    outer_link)
    return out


def _outer_seconds(b, link: Link, concurrent: int, cluster: Cluster) -> float:
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

    def layer_params(self) -> int:
        h = self.hidden
        kv = int(h * self.kv_heads_fraction)
        return 2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h

    def root_params(self) -> int:
        return (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


def parse_model_shape(text: str) -> ModelShape:
    """``layers=32,hidden=4096,ffn=11008,vocab=32000[,kv=0.25][,tied=1]``."""
    names = {"layers": "layers", "hidden": "hidden", "ffn": "ffn", "vocab": "vocab",
             "kv": "kv_heads_fraction", "tied": "tied"}
    values = {}
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
    return ModelShape(**values)


def shape_units(shape: ModelShape, inner: int, outer: int, dtypes: dict,
                reshard_after_forward: bool = True, outer_sharding: str = "none") -> list:
    """One unit per decoder layer and a root (embedding, head, final norm), each one
    buffer; per-parameter padding ignored (under one row per parameter)."""
    parts = outer if outer_sharding == "optim" else 1

    def unit(path, params, reshard):
        b = cost.BufferShape(shard_numel=math.ceil(params / inner / parts) * parts,
                             logical_numel=params, inner=inner, outer=outer, trainable=True,
                             outer_parts=parts, **dtypes)
        return cost.UnitShape(path, (b,), reshard, params)

    layers = [unit(f"layers.{i}", shape.layer_params(), reshard_after_forward)
              for i in range(shape.layers)]
    return layers + [unit("<root>", shape.root_params(), False)]


def dtype_bytes(config) -> dict:
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

    @property
    def comm_seconds(self) -> float:
        return sum(v for k, v in self.seconds.items() if k != "exposed")

    @property
    def exposed_seconds(self) -> float:
        return self.seconds["exposed"]

    @property
    def memory_total(self) -> float:
        return self.memory["params"] + self.memory["grads"] + self.memory["optimizer"] \
            + self.memory["peak_gathered"]


def evaluate(cluster: Cluster, units_for, micro_steps: int = 1, zero_stage=None,
             forward_prefetch: int = 1, activation_fraction: float = 0.3,
             outer_shardings: tuple = ("none",)) -> list[Option]:
    """Every ``outer`` dividing the world: ``units_for(outer, inner)`` gives the units
    (``units_for(outer, inner, "optim")`` those with outer sub-shards, for every
    ``outer > 1`` when ``outer_shardings`` names "optim")."""
    options = []
    world = cluster.world
    for outer in [o for o in range(1, world + 1) if world % o == 0]:
        inner = world // outer
        modes = [m for m in outer_shardings if m == "none" or outer > 1] or ["none"]
        for mode in modes:
            units = units_for(outer, inner) if mode == "none" else units_for(outer, inner,
                                                                             mode)
            options.append(_option(cluster, outer, inner, mode, units, micro_steps,
                                   zero_stage, forward_prefetch, activation_fraction))
    return options


def _option(cluster, outer, inner, mode, units, micro_steps, zero_stage, forward_prefetch,
            activation_fraction) -> Option:
    memory = cost.memory_per_rank(units, forward_prefetch)
    seconds = step_seconds(units, cluster, micro_steps, zero_stage)
    if inner == 1:
        label = "DDP (no sharding)"
    elif outer == 1:
        label = "FSDP (pure)"
    else:
        label = "HFSDP" if mode == "optim" else "HSDP"
    if inner == 1 and mode == "optim":
        label = "ZeRO-1 (HFSDP)"
    total = memory["params"] + memory["grads"] + memory["optimizer"] \
        + memory["peak_gathered"]
    fits = total <= (1 - activation_fraction) * cluster.device_memory_bytes
    return Option(outer, inner, label, memory, seconds, fits, cluster.ranks_per_node, mode)


def _ranks_per_node_of(options: list[Option]) -> int:
    return options[0].ranks_per_node if options else 1


def recommend(options: list[Option]) -> tuple[Option | None, str]:
    """The fitting option with the least communication time (ties: more sharding, so
    more memory left); the reason in words."""
    fitting = [o for o in options if o.fits]
    if not fitting:
        return None, ("no layout fits in device memory: shard more (tensor or pipeline "
                      "parallelism), offload, or use devices with more memory")
    def rank(o):
        return (round(o.exposed_seconds, 6), round(o.comm_seconds, 6), -o.inner)

    best = min(fitting, key=rank)
    why = (f"fits in memory ({best.memory_total / 2 ** 30:.1f} GiB of state + gathered "
           f"params per rank) and has the least exposed communication per step "
           f"({best.exposed_seconds * 1e3:.1f} ms of {best.comm_seconds * 1e3:.1f} ms")
    runner = sorted(fitting, key=rank)
    if len(runner) > 1:
        # another layout (the same layout's other fsdp_outer_sharding is in the table)
        second = next((o for o in runner if o.outer != best.outer),
                      next(o for o in runner if o is not best))
        why += (f"; next: outer {second.outer} x inner {second.inner} at "
                f"{second.exposed_seconds * 1e3:.1f} ms exposed")
    if best.inner > _ranks_per_node_of(options):
        why += ("; its shard group spans machines, so every all-gather crosses the slow "
                "link: tensor or pipeline parallelism inside a machine would let a smaller "
                "shard group fit")
    unfit = [o for o in options if not o.fits]
    if unfit:
        why += f"; {len(unfit)} layout(s) do not fit, e.g. {unfit[-1].label} " \
               f"({unfit[-1].memory_total / 2 ** 30:.1f} GiB)"
    return best, why + ")"


def table(cluster: Cluster, options: list[Option], best: Option | None, why: str,
          title: str) -> str:
    gib = 2.0 ** 30
    lines = [f"{title} on {cluster.name}: {cluster.nodes} nodes x {cluster.ranks_per_node} "
             f"ranks, intra {cluster.intra.bandwidth / _GBIT:g} Gbit/s "
             f"{cluster.intra.latency_s * 1e6:g} us, inter {cluster.inter.bandwidth / _GBIT:g} "
             f"Gbit/s {cluster.inter.latency_s * 1e6:g} us, "
             f"{cluster.device_memory_bytes / gib:g} GiB per device, intra-node "
             f"collectives {'hidden by prefetch' if cluster.overlap_intra_node else 'exposed'}",
             "",
             f"{'layout':<18s} {'outer x inner':>13s} {'GiB/rank':>9s} {'fits':>5s} "
             f"{'inner AG ms':>11s} {'inner RS ms':>11s} {'outer AR ms':>11s} "
             f"{'comm ms':>9s} {'exposed ms':>10s}"]
    for o in options:
        mark = " <- recommended" if o is best else ""
        lines.append(f"{o.label:<18s} {o.outer:>5d} x {o.inner:<5d} "
                     f"{o.memory_total / gib:>9.2f} {'yes' if o.fits else 'no':>5s} "
                     f"{o.seconds['inner all_gather'] * 1e3:>11.1f} "
                     f"{o.seconds['inner reduce_scatter'] * 1e3:>11.1f} "
                     f"{o.seconds['outer all_reduce'] * 1e3:>11.1f} "
                     f"{o.comm_seconds * 1e3:>9.1f} {o.exposed_seconds * 1e3:>10.1f}{mark}")
    mode = (f", fsdp_outer_sharding={best.outer_sharding}"
            if best is not None and best.outer_sharding != "none" else "")
    lines += ["", (f"recommended: fsdp_outer_degree={best.outer}{mode} (inner {best.inner}): "
                   f"{why}" if best else f"recommended: none: {why}")]
    return "\n".join(lines)
