"""A checkpoint save of a large job, planned in one process with the project's own
functions: every rank's decision of what it writes (paddle_hsdp.checkpoint.plan), and
rank 0's check and index of the whole save (checkpoint.save's tiling check and
metadata), for a Llama-70B-shaped model (723 tensors; bf16 params, AdamW with fp32
master weights and moments: 988 GB of distinct state).

    python tools/sim_checkpoint.py [--world 128 1024 8192] [--layout tp8 hsdp hfsdp] [--json]
    python tools/sim_checkpoint.py --joint [--groups 4 16] [--inner 8] [--json]

Layouts: ``tp8``: TP 8 x inner 8 x outer W/64; ``hsdp``: inner 8 x outer W/8;
``hfsdp``: inner W/128 x outer 128, the optimizer state cut across the outer ranks.
Per layout and world size it prints: a rank's planning CPU time and heap (the
slowest of a sample of ranks), rank 0's check and index of the whole save (CPU, heap,
the metadata's size), the slowest writer's bytes against the mean, the files written,
and the bytes a load reads from storage against the checkpoint's distinct bytes (the
outer replicas split the reading; the mp ranks of a tensor tensor parallelism does not
split each read it). With
``--json`` the last line is a JSON list of one object per run. Nothing is written.
Each run also counts the bytes of the manifests' trip to rank 0: what the padded gather
this replaced sent (W x the longest manifest) against what the save sends now (a
24-byte head per rank, then each rank's own bytes, as files).

``--joint``: a fault-tolerant HFSDP job's joint save (paddle_hsdp/ft/joint_save.py) of
the same model: ``--groups`` replica groups of ``--inner`` ranks, the optimizer state
cut into groups / 2 pieces, each box written by one group. Every group's manifests go
through the save's own code (checkpoint/save.py's group commit, ft's JointSave on a
store that records every value written, the publisher's read and check, its index);
it prints the largest value written to the job's store against the largest group's
manifests, which the joint save put there before (etcd refuses values over 1.5 MiB).
The groups' manifest files are written to a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import threading
import time
import tracemalloc
from types import SimpleNamespace

from paddle_hsdp.checkpoint import plan, save
from paddle_hsdp.checkpoint import rules as rules_mod
from paddle_hsdp.checkpoint.format import CheckpointError
from paddle_hsdp.checkpoint.items import item_of
from paddle_hsdp.engine.holdings import HeldBuffer, HeldTensor
from paddle_hsdp.engine.layout import segment_layout

HIDDEN, FFN, VOCAB, LAYERS, KV = 8192, 28672, 128256, 80, 1024


def llama70b() -> list[tuple[str, list[int], int | None]]:
    """``(name, shape [in, out] as Paddle's Linear holds it, tensor-parallel axis)``."""
    out = [("embed_tokens.weight", [VOCAB, HIDDEN], 0)]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [(p + "q_proj.weight", [HIDDEN, HIDDEN], 1), (p + "k_proj.weight", [HIDDEN, KV], 1),
                (p + "v_proj.weight", [HIDDEN, KV], 1), (p + "o_proj.weight", [HIDDEN, HIDDEN], 0),
                (p + "gate_proj.weight", [HIDDEN, FFN], 1), (p + "up_proj.weight", [HIDDEN, FFN], 1),
                (p + "down_proj.weight", [FFN, HIDDEN], 0),
                (p + "input_layernorm.weight", [HIDDEN], None),
                (p + "post_attention_layernorm.weight", [HIDDEN], None)]
    return out + [("norm.weight", [HIDDEN], None), ("lm_head.weight", [HIDDEN, VOCAB], 1)]


def units() -> list[list[tuple[str, list[int], int | None]]]:
    """The model's fully_shard units as a Llama recipe shards it: the embedding, each
    decoder layer, the final norm with the head."""
    params = llama70b()
    return [params[:1]] + [params[1 + 9 * i:10 + 9 * i] for i in range(LAYERS)] + [params[-2:]]


def _no_data(*_):
    raise AssertionError("a simulated rank holds no data: nothing is read or written")


def held(name, state, shape, dtype, offset, size, replicas, split=None, buffer=None,
         index=None, slice_offset=(0,), piece=None):
    """What engine/holdings.py's ``layout_of`` states of one tensor on one rank (no data),
    as the checkpoint's item it becomes (checkpoint/items.py ``item_of``)."""
    return item_of(HeldTensor(name, state, tuple(shape), dtype, tuple(offset), tuple(size),
                              replicas, _no_data, _no_data, split, slice_offset=slice_offset,
                              buffer=buffer, layout_index=index, piece=piece))


def held_buffer(u: int, seg, inner: int, i: int, parts: int, part: int,
                shared: bool = False) -> HeldBuffer:
    """Unit ``u``'s buffer as ``layout_of`` states it on inner rank ``i``, outer part
    ``part`` (no process groups in one process)."""
    return HeldBuffer(u, 0, False, seg, inner, i, parts, part, shared, None, None)


def layout(kind: str, world: int) -> dict:
    if kind == "tp8":
        lay = {"mp": 8, "inner": 8, "outer": world // 64, "optim_outer": False}
    elif kind == "hsdp":
        lay = {"mp": 1, "inner": 8, "outer": world // 8, "optim_outer": False}
    else:
        lay = {"mp": 1, "inner": world // 128, "outer": 128, "optim_outer": True}
    lay["parts"] = lay["outer"] if lay["optim_outer"] else 1
    # each unit's buffer as the engine lays it out (the same on every mp rank: the
    # slices have one shape); its segments: inner x parts
    lay["units"] = [(params, segment_layout([local_shape(shape, axis, lay["mp"])
                                             for _, shape, axis in params],
                                            lay["inner"] * lay["parts"]))
                    for params in units()]
    return lay


def local_shape(shape, axis, mp) -> list[int]:
    local = list(shape)
    if mp > 1 and axis is not None:
        local[axis] //= mp
    return local


def rank_items(lay: dict, m: int, i: int, o: int) -> list:
    """The items of the rank at mp ``m``, inner ``i``, outer ``o``, empty ones too."""
    mp, inner, outer, parts = lay["mp"], lay["inner"], lay["outer"], lay["parts"]
    out_axis = (("outer", outer, o),) if outer > 1 else ()
    mp_axis = (("mp", mp, m),) if mp > 1 else ()
    scalar_axes = ((("inner", inner, i),) if inner > 1 else ()) + out_axis + mp_axis
    items = []
    for u, (params, seg) in enumerate(lay["units"]):
        buf = held_buffer(u, seg, inner, i, parts, o if lay["optim_outer"] else 0)
        for k, (name, shape, axis) in enumerate(params):
            local, offset = local_shape(shape, axis, mp), [0] * len(shape)
            split = (axis, mp) if mp > 1 and axis is not None else None
            if split is not None:
                offset[axis] = m * local[axis]
            lo, count = seg.rows_in(k, i * parts, parts)  # the rank's inner block
            off = [offset[0] + lo] + offset[1:]
            size = [count] + local[1:]
            replicas = out_axis + (mp_axis if split is None else ())
            items.append(held(name, None, shape, "bfloat16", off, size, replicas, split, buf, k,
                              offset))
            sub_off, sub_size, sub_rep, piece = off, size, replicas, None
            if lay["optim_outer"]:  # HFSDP: its own rows of the segment, indexed by rule
                slo, scount = seg.rows_in(k, i * parts + o)
                sub_off = [offset[0] + slo] + offset[1:]
                sub_size = [scount] + local[1:]
                sub_rep, piece = (mp_axis if split is None else ()), o
            for state in ("master_weight", "moment1", "moment2"):
                items.append(held(name, state, shape, "float32", sub_off, sub_size, sub_rep,
                                  split, buf, k, offset, piece))
            for state in ("beta1_pow_acc", "beta2_pow_acc"):
                items.append(held(name, state, [1], "float32", [0], [1], scalar_axes))
    return items


def rank_writes(items) -> list:
    """What save_checkpoint's planning gives one rank: the plan of its listed items
    and its own ruled rows (checkpoint/save.py)."""
    held = [it for it in items if not it.empty]
    return (plan.plan_writes([it for it in held if it.spot is None])
            + save.ruled_writes([it for it in items if it.spot is not None]))


def rules_of(lay: dict) -> dict:
    """What the ranks send rank 0 of their ruled rows (checkpoint/save.py
    ``describe_rules``): one rule per unit and mp rank from each group's first rank,
    every rank's place in its FSDP group."""
    if not lay["optim_outer"]:
        return {}
    mp, inner, outer = lay["mp"], lay["inner"], lay["outer"]
    rules, places = {}, []
    for m in range(mp):
        gid = f"dense:{m}"
        places += [[gid, i, o, (o * inner + i) * mp + m] for o in range(outer)
                   for i in range(inner)]
        by_unit: dict = {}  # the group's first rank's ruled items, by buffer
        for it in rank_items(lay, m, 0, 0):
            if it.spot is not None and it.replicas.index == 0:
                by_unit.setdefault(it.spot.buffer.unit, []).append(it)
        for u, ruled in by_unit.items():
            tensors = {it.name: [it.spot.index, list(it.spot.base), it.size[1:], it.shape,
                                 it.dtype, it.split] for it in ruled}
            rules[f"{gid}/{u}.0"] = rules_mod.rule_of(ruled[0].spot.buffer, gid, 0, tensors)
    return {"rules": rules, "places": places}


def coords(lay: dict, rank: int) -> tuple[int, int, int]:
    """(mp, inner, outer) of ``rank`` (mp fastest, then inner, then outer)."""
    mp, inner = lay["mp"], lay["inner"]
    return rank % mp, (rank // mp) % inner, rank // (mp * inner)


def simulate(kind: str, world: int, sample: int, index_limit: int,
             ranks_only: bool = False) -> dict:
    lay = layout(kind, world)
    _PLANS.clear()  # the plans cached are this job's
    # one rank's planning, timed and traced, for a sample of ranks spread over the job
    ranks = sorted({round(k * (world - 1) / max(1, sample - 1)) for k in range(sample)})
    worst_cpu = worst_heap = 0.0

    def one_rank(r):
        return [_entry(w) for w in rank_writes(rank_items(lay, *coords(lay, r)))]

    for r in ranks:  # timed, then traced (tracemalloc slows allocation several times)
        worst_cpu = max(worst_cpu, _cpu(one_rank, r)[1])
        worst_heap = max(worst_heap, _heap(one_rank, r))
    if ranks_only:
        return {"layout": kind, "world": world, "save_cpu_s": round(worst_cpu, 3),
                "heap_mb": round(worst_heap / 2 ** 20, 1)}
    # every rank's writes: the outer replicas of a rank share its items but for the
    # outer index (and, with HFSDP, the optimizer's rows), so the plans are made on the
    # ranks at outer 0 (each holder computes the same) and read for every outer index
    loads, writers, distinct, held, n_pieces = [0] * world, 0, 0, 0, 0
    pieces: list | None = []
    sizes = [0] * world  # each rank's manifest, as save_checkpoint sends it to rank 0
    rules = rules_of(lay)
    for m in range(lay["mp"]):
        for i in range(lay["inner"]):
            items0: list = []  # outer 0's items (o == 0 comes first), read at every o
            for o in range(lay["outer"]):
                items = rank_items(lay, m, i, o) if o == 0 or lay["optim_outer"] else items0
                if o == 0:
                    items0 = items
                r = (o * lay["inner"] + i) * lay["mp"] + m
                held += sum(_read_bytes(it) for it in items if not it.empty)
                rank_writes_ = _writes_of(items, (m, i), o)
                sizes[r] = _manifest_bytes(lay, rules, items, rank_writes_, m, i, o, r)
                for w in rank_writes_:
                    nbytes = plan.item_bytes(w.item) * (w.hi - w.lo) // max(1, w.item.size[0])
                    distinct += nbytes
                    loads[r] += 0 if w.inline else nbytes
                    if w.item.spot is not None:
                        continue  # indexed by rule: no piece in the index
                    n_pieces += 1
                    if pieces is not None:
                        pieces.append(_entry(w))
                        if len(pieces) > index_limit:
                            pieces = None  # too many to index here: projected below
                writers += loads[r] > 0
    meta_bytes, refusal, index_cpu, index_heap = 0, None, float("nan"), float("nan")
    if pieces is not None:
        record = {"pieces": pieces, **rules}
        (meta_bytes, refusal), index_cpu = _cpu(_index, record)
        index_heap = _heap(_index, record) / 2 ** 20
    writing = [x for x in loads if x]
    mean = sum(writing) / max(1, len(writing))
    return {"layout": kind, "world": world, "save_cpu_s": round(worst_cpu, 3),
            "heap_mb": round(worst_heap / 2 ** 20, 1), "rank0_index_cpu_s": round(index_cpu, 2),
            "rank0_index_heap_mb": round(index_heap, 1), "pieces": n_pieces,
            "metadata_mb": round(meta_bytes / 2 ** 20, 1) if meta_bytes else None,
            "slowest_writer_x": round(max(loads) / mean, 3), "files": writers,
            "distinct_gb": round(distinct / 1e9, 1), "read_x": round(held / distinct, 2),
            "tiles": refusal is None, **gather_bytes(sizes)}


def gather_bytes(sizes: list[int]) -> dict:
    """What the manifests' trip to rank 0 moves, from each rank's manifest bytes:
    before, the padded gather (an all-reduce of the longest length, then every rank
    sends the longest + 8 bytes and rank 0 receives W of them); now, the 24-byte heads'
    gather and each other rank's own bytes, read by rank 0 from its file."""
    world = len(sizes)
    return {"manifests_mb": round(sum(sizes) / 2 ** 20, 1),
            "longest_manifest_kb": round(max(sizes) / 2 ** 10, 1),
            "rank0_gather_before_mb": round(world * (max(sizes) + 8) / 2 ** 20, 1),
            "rank0_gather_now_mb": round((24 * world + sum(sizes[1:])) / 2 ** 20, 1)}


def _at_outer(replicas, o: int) -> int:
    """``replicas.index`` at outer index ``o`` (the items of outer 0 are read for every
    outer index: the holders of a box differ from them only there)."""
    return plan.Replicas(tuple((a, n, o if a == "outer" else k)
                               for a, n, k in replicas.axes)).index


def _manifest_bytes(lay: dict, rules: dict, items, writes, m: int, i: int, o: int,
                    r: int) -> int:
    """The JSON bytes of rank ``r``'s manifest as checkpoint/save.py's ``_finish``
    builds it: its pieces, the boxes it is first holder of, and with HFSDP its place in
    its FSDP group and, on the group's first rank, the group's rules."""
    record: dict = {"pieces": [_entry(w) for w in writes if w.item.spot is None],
                    "error": None,
                    "expected": sorted({it.name for it in items
                                        if not it.empty and _at_outer(it.replicas, o) == 0})}
    if rules:
        gid = f"dense:{m}"
        record["rules"] = {k: v for k, v in rules["rules"].items()
                           if k.startswith(gid + "/")} if (i, o) == (0, 0) else {}
        record["places"] = [[gid, i, o, r]]
    return len(json.dumps(record).encode())


def _read_bytes(item) -> float:
    """What a load reads of ``item`` on its rank (checkpoint/load.py): a box its outer
    replicas hold is read once among them, a scalar not at all (it is in the index)."""
    if plan.inline(item):
        return 0.0
    outer = [n for a, n, _ in item.replicas.axes if a == "outer"]
    return plan.item_bytes(item) / (outer[0] if outer else 1)


def _cpu(fn, *args):
    t0 = time.process_time()
    result = fn(*args)
    return result, time.process_time() - t0


def _heap(fn, *args) -> int:
    """The peak bytes Python allocated while ``fn(*args)`` ran."""
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


_PLANS: dict = {}


def _writes_of(items, mi, o):
    """The writes of the rank at ``mi`` = (mp, inner) and outer ``o`` holding ``items``,
    from one plan per kind and holder group (each holder computes the same)."""
    out = save.ruled_writes([it for it in items if it.spot is not None])
    by_kind: dict = {}
    for it in items:
        if it.spot is None and not it.empty:
            by_kind.setdefault(it.replicas.kind, []).append(it)
    for kind, group in by_kind.items():
        replicas = group[0].replicas
        varied = {a for a, _ in kind}
        # the holder group: the coordinates its axes do not vary
        key = (kind, None if "mp" in varied else mi[0], None if "inner" in varied else mi[1],
               None if "outer" in varied else o)
        if key not in _PLANS:
            _PLANS[key] = plan.assign(kind, sorted(group, key=lambda it: it.name),
                                      replicas.count)
        index = replicas.index if "outer" not in varied else \
            plan.Replicas(tuple((a, n, o if a == "outer" else k)
                                for a, n, k in replicas.axes)).index
        out += [w for w, holder in _PLANS[key] if holder == index]
    return out


def _entry(w) -> dict:
    """A manifest entry as checkpoint/save.py makes it (CRCs as placeholders)."""
    it = w.item
    piece = {"offset": w.offset, "shape": w.shape, "name": it.name,
             "full_shape": it.shape, "dtype": it.dtype, "split": it.split, "stage": 0,
             "tag": ""}
    if w.inline:
        piece.update(value=[1.0], value_dtype="float32")
    else:
        rows = w.hi - w.lo
        chunk = max(1, (4 << 20) // max(1, plan.item_bytes(it) // max(1, it.size[0])))
        piece.update(file="rank-00000.safetensors", key=it.name, chunk_rows=chunk,
                     crc32=[0] * math.ceil(rows / chunk))
    return piece


def _index(record: dict) -> tuple[int, str | None]:
    """Rank 0: the manifests into the metadata's tensors, checked (checkpoint/save.py's
    ``index_manifests``), and its JSON's size; the refusal, if any."""
    record = json.loads(json.dumps(record))  # rank 0 decodes what the ranks sent
    tensors: dict = {}
    try:
        rules, groups, _ = save.index_manifests(tensors, [record])
    except CheckpointError as e:
        return 0, str(e)
    meta = {"tensors": tensors, "rules": rules, "rank_groups": groups}
    return len(json.dumps(meta, separators=(",", ":"))), None


# ---------------------------------------------------------------- the joint save
def joint_items(groups: int, inner: int, parts: int, g: int, i: int, lay_units) -> list:
    """What rank ``i`` of replica group ``g`` holds in a fault-tolerant HFSDP job
    (engine/holdings.py with shared pieces: no rule, every box listed): its inner block
    of each parameter (held by every group), its piece's rows of each optimizer state
    (piece ``g % parts``: held by the groups of that piece), the beta powers (every
    rank)."""
    outer_axis = (("outer", groups, g),)
    piece = g % parts
    items = []
    for u, (params, seg) in enumerate(lay_units):
        buf = held_buffer(u, seg, inner, i, parts, piece, shared=True)
        for k, (name, shape, _) in enumerate(params):
            base = [0] * len(shape)
            lo, count = seg.rows_in(k, i * parts, parts)
            items.append(held(name, None, shape, "bfloat16", [lo] + base[1:],
                              [count] + shape[1:], outer_axis, None, buf, k, base))
            slo, scount = seg.rows_in(k, i * parts + piece)
            for state in ("master_weight", "moment1", "moment2"):
                items.append(held(name, state, shape, "float32", [slo] + base[1:],
                                  [scount] + shape[1:], (), None, buf, k, base, piece))
            for state in ("beta1_pow_acc", "beta2_pow_acc"):
                items.append(held(name, state, [1], "float32", [0], [1],
                                  (("inner", inner, i),) + outer_axis))
    return items


def joint_payloads(groups: int, inner: int, redundancy: int = 2) -> dict[int, dict]:
    """Every group's manifests as its leader hands them to the joint save
    (checkpoint/save.py ``_publish_jointly``: ``{"manifests": [one per rank],
    "errors": []}``): each box written by one group, the lowest live one holding it
    (ft/joint_save.py ``writes``), planned inside the group (the outer axis dropped)."""
    parts = max(1, groups // redundancy)
    lay_units = [(params, segment_layout([shape for _, shape, _ in params], inner * parts))
                 for params in units()]
    out = {}
    for g in range(groups):
        records = []
        for i in range(inner):
            items = joint_items(groups, inner, parts, g, i, lay_units)
            held = [it for it in items if not it.empty and
                    (g == 0 if it.piece is None else g == it.piece)]
            writes = plan.plan_writes(held, drop_axes=("outer",))
            records.append({"pieces": [_entry(w) for w in writes], "error": None,
                            "expected": sorted({it.name for it in held if
                                                it.replicas.without(("outer",)).index == 0})})
        out[g] = {"manifests": records, "errors": []}
    return out


class RecordingStore:
    """The job's shared data (ft/kv.py JobStore's set, get, add) in memory, keeping the
    size of every value written: what etcd would be asked to hold."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.largest: dict[str, int] = {}
        self.lock = threading.Lock()
        self.leases: list[float] = []  # each lease's ttl_s, in grant order

    def lease(self, ttl_s):
        """A lease id (JobStore.lease: the save's keys end with it); its ttl recorded."""
        with self.lock:
            self.leases.append(ttl_s)
            return len(self.leases)

    def set(self, name, value, lease=None):
        raw = value.encode() if isinstance(value, str) else value
        with self.lock:
            self.data[name] = raw
            self.largest[name] = max(self.largest.get(name, 0), len(raw))

    def get(self, name, timeout_s=None, abort=None):
        with self.lock:
            return self.data[name]

    def add(self, name, amount, lease=None):
        with self.lock:
            value = int(self.data.get(name, b"0")) + amount
        self.set(name, str(value), lease=lease)
        return value


def simulate_joint(groups: int, inner: int, redundancy: int = 2) -> dict:
    """A joint save's control-plane values, through the save's own code: each group's
    leader commits its manifests (a file and a record) and counts in through
    ft/joint_save.py's JointSave; the last one reads every group's file back, checked,
    and indexes the whole save. Returns the largest value written to the store against
    the largest group's manifests (what the joint save wrote there before)."""
    from paddle_hsdp.ft.joint_save import JointSave
    payloads = joint_payloads(groups, inner, redundancy)
    before = {g: len(json.dumps(p).encode()) for g, p in payloads.items()}
    store, replicas = RecordingStore(), list(range(groups))
    record = SimpleNamespace(number=1, replicas=replicas)
    with tempfile.TemporaryDirectory(prefix="sim_joint_") as tmp:
        joints = [JointSave(SimpleNamespace(
            round=record, step=1, store=store, replica_id=g, ranks_per_replica=inner,
            round_timeout_s=1.0, outer=None)) for g in replicas]
        for j in joints:
            j.begin(os.path.join(tmp, "ckpt"))
        commits = None
        for g in replicas[::-1]:  # the publisher (the lowest group) last: one thread
            got = joints[g].gather(save._commit_group(tmp, g * inner, payloads[g]))
            commits = got if got is not None else commits
        manifests, errors = save._read_groups(tmp, commits)
        joints[0].announce("; ".join(errors))
        files_mb = sum(os.path.getsize(os.path.join(tmp, save.MANIFESTS, f))
                       for f in os.listdir(os.path.join(tmp, save.MANIFESTS))) / 2 ** 20
    meta_bytes, refusal = _index({"pieces": [p for m in manifests for p in m["pieces"]],
                                  "expected": [n for m in manifests for n in m["expected"]]})
    return {"groups": groups, "inner": inner, "pieces": max(1, groups // redundancy),
            "largest_group_manifests_kb": round(max(before.values()) / 2 ** 10, 1),
            "group_manifests_kb": sorted({round(v / 2 ** 10) for v in before.values()}),
            "largest_store_value_bytes": max(store.largest.values()),
            "store_values": len(store.largest), "manifest_files_mb": round(files_mb, 1),
            "errors": errors, "tiles": refusal is None and not errors,
            "metadata_mb": round(meta_bytes / 2 ** 20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--layout", nargs="+", default=["tp8", "hsdp", "hfsdp"],
                        choices=["tp8", "hsdp", "hfsdp"])
    parser.add_argument("--sample", type=int, default=8, help="ranks timed per run")
    parser.add_argument("--index-limit", type=int, default=3_000_000,
                        help="pieces beyond which rank 0's index is not built (only counted)")
    parser.add_argument("--ranks-only", action="store_true",
                        help="only each sampled rank's planning (not the job's writers and "
                             "index: HFSDP at 8,192 would need tens of GB here)")
    parser.add_argument("--joint", action="store_true",
                        help="a fault-tolerant HFSDP job's joint save (--groups, --inner)")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--inner", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    if args.joint:
        for groups in args.groups:
            run = simulate_joint(groups, args.inner)
            runs.append(run)
            print(f"groups {groups:4d} x {args.inner} ranks: largest group's manifests "
                  f"{run['largest_group_manifests_kb']:.0f} KiB (each group's: "
                  f"{run['group_manifests_kb']} KiB) -> largest store value "
                  f"{run['largest_store_value_bytes']} B of {run['store_values']}; "
                  f"files {run['manifest_files_mb']} MiB; tiles {run['tiles']}", flush=True)
        if args.json:
            print(json.dumps(runs))
        return
    print(f"{'layout':7s} {'W':>6s} {'plan cpu s':>10s} {'heap MB':>8s} {'rank0 s':>8s} "
          f"{'rank0 MB':>9s} {'pieces':>9s} {'meta MB':>8s} {'slowest':>8s} {'files':>6s} "
          f"{'read x':>7s}")
    for kind in args.layout:
        for world in args.world:
            run = simulate(kind, world, args.sample, args.index_limit, args.ranks_only)
            if args.ranks_only:
                runs.append(run)
                print(f"{kind:7s} {world:6d} {run['save_cpu_s']:10.3f} {run['heap_mb']:8.1f}",
                      flush=True)
                continue
            runs.append(run)
            print(f"{kind:7s} {world:6d} {run['save_cpu_s']:10.3f} {run['heap_mb']:8.1f} "
                  f"{run['rank0_index_cpu_s']:8.2f} {run['rank0_index_heap_mb']:9.1f} "
                  f"{run['pieces']:9d} {run['metadata_mb'] or float('nan'):8.1f} "
                  f"{run['slowest_writer_x']:7.3f}x "
                  f"{run['files']:6d} {run['read_x']:6.1f}x"
                  + ("" if run["tiles"] else "  (DOES NOT TILE)"), flush=True)
            print(f"{'':7s} manifests to rank 0: {run['manifests_mb']} MiB in all, the "
                  f"longest {run['longest_manifest_kb']} KiB; the padded gather "
                  f"{run['rank0_gather_before_mb']} MiB, now {run['rank0_gather_now_mb']} "
                  "MiB", flush=True)
    if args.json:
        print(json.dumps(runs))


if __name__ == "__main__":
    main()
