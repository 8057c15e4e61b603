"""GPU kernels read from a profiler result or a chrome trace, and how much of each kind of
NCCL kernel's time ran under compute kernels (interval arithmetic on their spans)."""

from __future__ import annotations

import json
import re


def union(intervals) -> list:
    """Sorted, merged ``[start, end)`` intervals."""
    out = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def length(intervals) -> float:
    return float(sum(e - s for s, e in union(intervals)))


def intersection_length(a, b) -> float:
    a, b = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_kind(name: str) -> str:
    """``compute``, or the collective an NCCL kernel runs (``nccl`` when its name does
    not say)."""
    low = name.lower().replace("_", "")
    if "nccl" not in low:
        return "compute"
    for kind in ("reducescatter", "allgather", "allreduce", "broadcast", "sendrecv"):
        if kind in low:
            return {"reducescatter": "reduce_scatter", "allgather": "all_gather",
                    "allreduce": "all_reduce"}.get(kind, kind)
    return "nccl"


def overlap_report(kernels) -> dict:
    """``kernels``: (name, start, end, stream) of GPU kernels on one device. For each
    kind of NCCL kernel: its count, busy time, the fraction of that time during which
    a compute kernel also ran, and its streams; ``nccl_all`` for every NCCL kernel."""
    compute = [(s, e) for n, s, e, _ in kernels if kernel_kind(n) == "compute"]
    groups: dict = {}
    for name, start, end, stream in kernels:
        kind = kernel_kind(name)
        if kind != "compute":
            for key in (kind, "nccl_all"):
                groups.setdefault(key, []).append((start, end, stream))
    report = {"compute_kernels": len(compute), "compute_time": length(compute)}
    for kind, items in groups.items():
        spans = [(s, e) for s, e, _ in items]
        busy = length(spans)
        report[kind] = {"count": len(items), "time": busy,
                        "overlapped": intersection_length(spans, compute) / busy if busy
                        else 0.0,
                        "streams": sorted({str(st) for _, _, st in items})}
    return report


def kernels_from_nodes(trees) -> list:
    """(name, start_us, end_us, stream) of every GPU kernel in a profiler result's
    ``get_data()`` ({thread: host node tree}), from each host node's ``runtime_node``
    (and ``device_node``) lists."""
    seen, out = set(), []
    stack = list(trees.values()) if isinstance(trees, dict) else list(trees)
    while stack:
        node = stack.pop()
        stack.extend(getattr(node, "children_node", []) or [])
        devices = list(getattr(node, "device_node", []) or [])
        for runtime in getattr(node, "runtime_node", []) or []:
            devices += list(getattr(runtime, "device_node", []) or [])
        for dev in devices:
            if _type_name(getattr(dev, "type", "")) != "Kernel":
                continue
            item = (dev.name, int(dev.start_ns) / 1e3, int(dev.end_ns) / 1e3,
                    getattr(dev, "stream_id", "?"))
            if item not in seen:
                seen.add(item)
                out.append(item)
    return out


def _type_name(t) -> str:
    return getattr(t, "name", None) or str(t).split(".")[-1]


def kernels_from_chrome_trace(path: str) -> list:
    """(name, start_us, end_us, stream) of every ``"cat": "Kernel"`` event of a chrome
    trace Paddle exported (its names end in ``[duration]``, which is cut off)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    out = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("cat") != "Kernel" or ev.get("ph") != "X":
            continue
        name = re.sub(r"\[[^\[\]]*\]$", "", str(ev.get("name", "")))
        start = float(ev["ts"])
        stream = (ev.get("args") or {}).get("stream", ev.get("tid", "?"))
        out.append((name, start, start + float(ev.get("dur", 0.0)), stream))
    return out
