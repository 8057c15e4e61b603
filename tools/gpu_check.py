"""The first GPU run of paddle_hsdp (issue 24): what only NCCL on real GPUs can show.

On one machine with 2+ GPUs and a CUDA build of Paddle (docs/gpu.md, "First GPU run"):

    bash tools/gpu_check.sh                     # every check, 3 launches, then one table
    python -m paddle.distributed.launch --devices 0,1 tools/gpu_check.py   # one launch

Rank 0 prints one table, a row a check (PASS / FAIL / SKIP with its figures), and writes
it as JSON under ``--out``. The checks (``--only`` takes a comma-separated list):

* ``layout``: TinyLM (test_collective/workers/models.py) trained on the fleet layout
  (``--layout``, default 1xN: ``fsdp_outer_degree`` 1) and on the other one (2x(N/2))
  through an explicit ``ProcessMesh``, against single-GPU training on the whole batch:
  losses and every full parameter, fp32, within ``FP32_BOUND``;
* ``overlap``: step time of a Llama-shaped model (tools/bench_model.py) with overlap on
  (the defaults: async collectives, one unit of prefetch) and off
  (``enable_tensor_fusion_and_overlap=False``, prefetch 0), and the ratio;
* ``profile``: a ``paddle.profiler`` trace of two steps (chrome trace under ``--out``),
  and the fraction of reduce-scatter / all-gather kernel time that overlaps compute
  kernels;
* ``offload``: ``CPUOffloadPolicy(pin_memory=True)`` against no offload (losses and
  params), and where the optimizer's tensors live: every shard, its grad and every
  optimizer accumulator on a plain CPU place (not the GPU, not pinned);
* ``bf16``: ``MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")``
  against fp32: loss curves within ``BF16_LOSS_BOUND``, nothing NaN or inf;
* ``mismatch``: odd ranks run TinyLM's blocks in another order (equal sizes: the
  collectives pair up and nothing else fails) in an eval forward and in a training
  step: ``CollectiveMismatchError`` expected on every rank, with the seconds it took;
* ``mismatch_hang`` (only when asked for: it can end the process): the last rank calls a
  block once more than the others; expected: ``CollectiveMismatchError`` where the
  pairing shows it, and the watchdog (``PADDLE_HSDP_COLLECTIVE_TIMEOUT``) ending the
  rank left waiting, naming what it waited for. tools/gpu_check.sh runs it in a launch
  of its own and ``--report`` reads the outcome from the records and worker logs.

Without 2+ GPUs and a CUDA build it exits at once with status 2 and one line.
``--cpu-rehearsal`` runs the same code on CPU ranks (gloo; device-side tag flags and the
offload path forced on, as the tests do) to rehearse the script, not to measure anything. Unverified on a GPU: no GPU was
available to the project when it was written.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKERS = os.path.join(ROOT, "test_collective", "workers")

CHECKS = ("layout", "overlap", "profile", "offload", "bf16", "mismatch", "mismatch_hang")
DEFAULT_CHECKS = CHECKS[:-1]  # mismatch_hang may end the process: asked for by name
EXIT_NO_GPU = 2
NO_GPU = "needs 2+ GPUs with a CUDA build of Paddle"

# fp32 parity, max |a - b| / max |b| per tensor (test_collective/workers/parity.py's
# measure). The CPU floor is 1e-6..2e-6 and the CPU bound 3e-5; GPU kernels differ with
# the batch shape (cuBLAS picks another algorithm for a half batch) and TF32 is turned
# off (NVIDIA_TF32_OVERRIDE=0). A first guess: set it from the first run's figures.
FP32_BOUND = 1e-4
BF16_LOSS_BOUND = 1e-2  # bf16 has 8 mantissa bits: ~4e-3 per rounding
OVERLAP_MIN = 0.10  # fraction of reduce-scatter / all-gather time under compute
SPEED_MIN = 0.98  # off/on step time: overlap must not be slower (2% for noise)
MICRO, PER_RANK, CLIP = 2, 2, 0.2  # the parity workers' settings (worker_mesh.py)
TIMED_ROUNDS = 2  # overlap on / off alternate this many times; the best of each counts


# ------------------------------------------------------------------ arguments, set-up
def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="paddle_hsdp's first GPU run: layouts, overlap, a profiler trace, CPU "
                    "offload, bf16 and a mismatched unit on 2+ GPUs with NCCL. Launch: "
                    "python -m paddle.distributed.launch --devices 0,1 tools/gpu_check.py, "
                    "or bash tools/gpu_check.sh (every check, one table).")
    ap.add_argument("--only", type=_check_list, default=list(DEFAULT_CHECKS),
                    help=f"comma-separated checks, in this order: {', '.join(CHECKS)} "
                         f"(default: all but mismatch_hang)")
    ap.add_argument("--steps", type=_positive, default=5,
                    help="training steps per check (default 5; step times are measured "
                         "over 2 x steps)")
    ap.add_argument("--out", default=os.path.join("runs", "gpu_check"),
                    help="folder for the JSON results, traces and logs "
                         "(default runs/gpu_check)")
    ap.add_argument("--layout", default=None,
                    help="the fleet layout OUTERxINNER (default 1xN, N ranks); the layout "
                         "check also runs the other one (2x(N/2), or Nx1) on a ProcessMesh")
    ap.add_argument("--shape", default="73m", choices=("tiny", "4m", "73m", "140m"),
                    help="tools/bench_model.py shape for the overlap and profile checks "
                         "(default 73m; tiny in --cpu-rehearsal)")
    ap.add_argument("--timeout", type=_positive, default=60,
                    help="PADDLE_HSDP_COLLECTIVE_TIMEOUT in seconds when it is not set "
                         "(default 60): the bound the mismatch checks expect")
    ap.add_argument("--phase", default="main",
                    help="name of this launch's results file (tools/gpu_check.sh sets it)")
    ap.add_argument("--report", metavar="OUT",
                    help="no launch: merge OUT's results and worker logs into one table")
    ap.add_argument("--preflight", action="store_true",
                    help="only check the flags, 2+ GPUs and a CUDA build; print the GPU "
                         "count")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run on CPU ranks (gloo) to rehearse the script; measures nothing")
    return ap.parse_args(argv)


def _check_list(text: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check(s) {unknown or text!r}; choose from {', '.join(CHECKS)}")
    return [c for c in CHECKS if c in names]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parse_layout(text: str, world: int) -> tuple:
    """``"OUTERxINNER"`` -> (outer, inner), their product the world size."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
    if not m:
        raise ValueError(f"--layout {text!r}: write it as OUTERxINNER, e.g. 1x{world}")
    outer, inner = int(m.group(1)), int(m.group(2))
    if outer < 1 or inner < 1 or outer * inner != world:
        raise ValueError(f"--layout {text}: OUTER x INNER must be the {world} ranks")
    return outer, inner


def other_layout(layout: tuple, world: int) -> tuple:
    """The layout the mesh front end checks next to the fleet one: 2x(N/2) (Nx1 for an
    odd N) next to 1xN; 1xN next to anything else."""
    if layout[0] != 1:
        return 1, world
    return (2, world // 2) if world % 2 == 0 else (world, 1)


def gpu_problem(cuda_build: bool, gpus: int, world: int, version: str = "?",
                launched: bool = False):
    """Why this process cannot run the GPU checks (one line), or None."""
    if not cuda_build:
        return (f"gpu_check: {NO_GPU}; found a CPU-only build of Paddle {version} "
                f"({gpus} GPUs visible)")
    if not launched:
        if gpus < 2:
            return f"gpu_check: {NO_GPU}; found {gpus} GPU{'s' if gpus != 1 else ''}"
        return None
    if world < 2:
        return (f"gpu_check: {NO_GPU} and a rank on each; found {gpus} GPUs and 1 rank: run "
                "python -m paddle.distributed.launch --devices 0,1 tools/gpu_check.py, or "
                "bash tools/gpu_check.sh")
    if gpus < 1:
        return f"gpu_check: {NO_GPU}; this rank sees no GPU"
    return None


def _import_paddle():
    """``import paddle`` without its import-time warnings (no ccache, ...): the no-GPU
    answer stays one line."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import paddle
    return paddle


def _fail_fast(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.exit(EXIT_NO_GPU)


# ------------------------------------------------------------------ rows and the table
STATUSES = ("PASS", "FAIL", "SKIP")


def row(check: str, status: str, figures: str, **detail) -> dict:
    assert status in STATUSES, status
    return {"check": check, "status": status, "figures": figures, "detail": detail}


def in_check_order(rows: list) -> list:
    """Rows sorted by their check's place in CHECKS (by name prefix; others last)."""
    def key(r):
        names = [c for c in CHECKS if r["check"].startswith(c)]
        return CHECKS.index(max(names, key=len)) if names else len(CHECKS)
    return sorted(rows, key=key)


def format_table(rows: list, header: str = "") -> str:
    """One table: check | status | figures; figures wrap under their column."""
    width = max([len("check")] + [len(r["check"]) for r in rows])
    lines = [header] if header else []
    lines += [f"{'check':<{width}}  status  figures", f"{'-' * width}  ------  -------"]
    for r in rows:
        parts = _wrap(r["figures"], 88)
        lines.append(f"{r['check']:<{width}}  {r['status']:<6}  {parts[0]}")
        lines += [f"{'':<{width}}  {'':<6}  {p}" for p in parts[1:]]
    n = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines.append(f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped")
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list:
    words, out, line = text.split(" "), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            out.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return out + [line]


def exit_status(rows: list) -> int:
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


# ------------------------------------------------------------------ measures
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


def place_kind(tensor) -> str:
    """``cpu`` (plain host memory), ``pinned``, ``gpu`` or ``other``."""
    place = tensor.place
    for kind, method in (("pinned", "is_cuda_pinned_place"), ("gpu", "is_gpu_place"),
                         ("cpu", "is_cpu_place")):
        test = getattr(place, method, None)
        if test is not None and test():
            return kind
    return "other"


def storage_report(optimizer) -> dict:
    """Where the optimizer's tensors live: the shards it holds
    (``optimizer._parameter_list``, param groups flattened), their grads and every
    accumulator (``optimizer._accumulators``: {kind: {param name: tensor}}). ``bad``
    lists those not on a plain CPU place."""
    params = []
    for item in optimizer._parameter_list or []:
        params += list(item["params"]) if isinstance(item, dict) else [item]
    counts = {"params": 0, "grads": 0, "accumulators": 0, "no_grad": 0}
    bad = []

    def look(what, name, tensor):
        counts[what] += 1
        kind = place_kind(tensor)
        if kind != "cpu":
            bad.append(f"{what[:-1]} {name}: {kind}")

    for p in params:
        look("params", p.name, p)
        if p.grad is not None:
            look("grads", p.name, p.grad)
        elif not p.stop_gradient:
            counts["no_grad"] += 1
    for acc, by_param in (getattr(optimizer, "_accumulators", None) or {}).items():
        for name, tensor in by_param.items():
            look("accumulators", f"{acc}[{name}]", tensor)
    return dict(counts, bad=bad)


# ------------------------------------------------------------------ mismatch outcomes
WATCHDOG_LINE = re.compile(
    r"paddle_hsdp watchdog \(rank (\S+)\): (.*?) has not finished after (\d+) s")


def watchdog_lines(log_dir: str) -> dict:
    """{phase folder: {rank: (seconds, what)}} from the worker logs under ``log_dir``
    (``log_dir/<phase>/workerlog.N``, as tools/gpu_check.sh lays them out)."""
    found: dict = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "**", "workerlog.*"), recursive=True)):
        phase = os.path.basename(os.path.dirname(path))
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = WATCHDOG_LINE.search(line)
                if m:
                    found.setdefault(phase, {})[m.group(1)] = (int(m.group(3)), m.group(2))
    return found


def summarise_mismatch(check: str, records: list, world: int, watchdog: dict | None = None,
                       bound: float | None = None,
                       accept: tuple = ("CollectiveMismatchError",)) -> dict:
    """One row from every rank's record of a mismatch variant (``{"rank", "outcome",
    "where", "seconds", "message"}``; ``outcome`` None: started, never finished) and the
    watchdog's lines ({rank: (seconds, what)}). PASS: every rank raised one of
    ``accept`` or was ended by the watchdog naming what it waited for."""
    watchdog = watchdog or {}
    by_rank = {}
    for rec in records:
        if rec.get("check") == check and (rec.get("outcome") or rec["rank"] not in by_rank):
            by_rank[rec["rank"]] = rec
    parts, ok = [], True
    for rank in range(world):
        rec, dog = by_rank.get(rank), watchdog.get(str(rank))
        outcome = (rec or {}).get("outcome")
        if outcome:
            ok &= outcome in accept
            text = f"rank {rank}: {outcome} in {rec.get('where', '?')} after " \
                   f"{rec.get('seconds', 0):.2f} s"
            if outcome != "CollectiveMismatchError":
                text += f": {rec.get('message', '')[:160]}"
        elif dog:
            text = (f"rank {rank}: ended by the watchdog after {dog[0]} s"
                    f"{f' (bound {bound:g} s)' if bound else ''}, waiting for {dog[1][:160]}")
        else:
            ok = False
            text = (f"rank {rank}: no outcome recorded and no watchdog line "
                    f"({'started' if rec else 'never started'})")
        parts.append(text)
    first = next((r.get("message", "") for r in by_rank.values()
                  if r.get("outcome") == "CollectiveMismatchError"), "")
    return row(check, "PASS" if ok else "FAIL", "; ".join(parts), message=first)


def read_records(out: str, phase: str = "*") -> list:
    """Every rank's mismatch records under ``out`` (results/mismatch.<phase>.rank<r>.jsonl);
    a line another rank is still writing is left for the next read."""
    records = []
    pattern = os.path.join(out, "results", f"mismatch.{phase}.rank*.jsonl")
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
    return records


# ------------------------------------------------------------------ --report
MISMATCH_VARIANTS = ("mismatch (eval forward)", "mismatch (training step)")
HANG = "mismatch_hang (extra call)"
# A rank left waiting by the extra call: on gloo its peer's exit fails the collective
# (CollectiveError naming the op); on NCCL nothing fails and the watchdog ends it.
HANG_OUTCOMES = ("CollectiveMismatchError", "CollectiveError")


def report(out: str, log_dir: str | None = None) -> tuple:
    """Every launch's rows under ``out`` (results/<phase>.json), the mismatch_hang row
    built from the ranks' records and the watchdog's lines, a FAIL row for each launch
    that ended badly without rows and for every watchdog exit outside mismatch_hang.
    Returns (rows, header)."""
    log_dir = log_dir or os.path.join(out, "logs")
    rows, metas = [], {}
    paths = glob.glob(os.path.join(out, "results", "*.json"))
    for path in sorted(paths, key=lambda p: (os.path.basename(p) != "main.json", p)):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        phase = os.path.basename(path)[:-len(".json")]
        metas[phase] = data.get("meta", {})
        rows += [r for r in data.get("rows", []) if r["check"] != HANG]
        for check in data.get("planned", []):
            if check not in data.get("done", []) and check != "mismatch_hang":
                rows.append(row(check, "FAIL", f"no result: launch {phase} ended before "
                                f"this check did (exit status {_rc(log_dir, phase)}); logs "
                                f"in {os.path.join(log_dir, phase)}"))
    dogs = watchdog_lines(log_dir)
    world = max([m.get("world", 0) for m in metas.values()] + [0])
    records = read_records(out)
    if any(r.get("check") == HANG for r in records):
        bound = next((r.get("bound") for r in records if r.get("bound")), None)
        world = world or 1 + max(r["rank"] for r in records)
        rows.append(summarise_mismatch(HANG, records, world, dogs.get("mismatch_hang"), bound,
                                       accept=HANG_OUTCOMES))
    for phase, by_rank in dogs.items():
        if phase != "mismatch_hang":
            for rank, (secs, what) in sorted(by_rank.items()):
                rows.append(row(f"watchdog ({phase})", "FAIL",
                                f"rank {rank} ended after {secs} s waiting for {what[:200]}"))
    for rc_path in sorted(glob.glob(os.path.join(log_dir, "*", "rc"))):
        phase = os.path.basename(os.path.dirname(rc_path))
        rc = _rc(log_dir, phase)
        if rc != "0" and phase != "mismatch_hang" and not os.path.exists(
                os.path.join(out, "results", f"{phase}.json")):
            rows.append(row(f"launch {phase}", "FAIL",
                            f"exit status {rc} before any result; logs in "
                            f"{os.path.dirname(rc_path)}"))
    meta = metas.get("main") or next(iter(metas.values()), {})
    header = describe(meta) if meta else f"gpu_check results in {out}"
    return in_check_order(rows), header


def _rc(log_dir: str, phase: str) -> str:
    """A launch's exit status as tools/gpu_check.sh recorded it, or "?"."""
    try:
        with open(os.path.join(log_dir, phase, "rc")) as f:
            return f.read().strip()
    except OSError:
        return "?"


def describe(meta: dict) -> str:
    return (f"gpu_check: {meta.get('world', '?')} x {meta.get('gpu', '?')}, Paddle "
            f"{meta.get('paddle', '?')} (CUDA {meta.get('cuda', '?')}, NCCL "
            f"{meta.get('nccl', '?')}), fleet layout {meta.get('layout', '?')}, "
            f"{meta.get('steps', '?')} steps{' [CPU REHEARSAL]' if meta.get('rehearsal') else ''}")


def write_report(out: str, rows: list, header: str) -> str:
    path = os.path.join(out, "gpu_check.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    return path


# ------------------------------------------------------------------ the GPU run
class Run:
    """What every check shares: the process's rank, layout, data and references."""

    def __init__(self, args):
        import paddle
        import paddle.distributed as dist

        import common
        import models

        self.args, self.paddle, self.dist = args, paddle, dist
        self.common, self.models = common, models
        world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
        self.layout = parse_layout(args.layout or f"1x{world}", world)
        self.other = other_layout(self.layout, world)
        common.init_fleet({"sharding_degree": world, "outer": self.layout[0]})
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out = args.out
        self.rows: list = []
        self.done: list = []  # checks finished, for --report to name the missing ones
        self._data = self._ref = None

    # shared inputs
    def data(self):
        if self._data is None:
            self._data = self.models.batches(self.args.steps, MICRO, self.world, PER_RANK)
        return self._data

    def reference(self):
        """Single-GPU training on the whole batch (each rank computes it, unsharded)."""
        if self._ref is None:
            self._ref = self.models.train_reference(self.data(), self.world, PER_RANK, CLIP)
        return self._ref

    def tinylm(self, **kwargs):
        model = self.models.shard_tinylm(self.models.build_model(), **kwargs)
        return model, self.models.make_optimizer(model, model.parameters(), CLIP)

    def mesh(self, layout):
        from paddle.distributed import ProcessMesh

        outer, inner = layout
        ranks = list(range(self.world))
        if outer == 1:
            return ProcessMesh(ranks)
        return ProcessMesh([ranks[i * inner:(i + 1) * inner] for i in range(outer)],
                           dim_names=["outer", "inner"])

    def add(self, check: str, new_rows: list):
        self.rows += new_rows
        self.done.append(check)
        if self.rank == 0:
            self.save()

    def save(self):
        os.makedirs(os.path.join(self.out, "results"), exist_ok=True)
        with open(os.path.join(self.out, "results", f"{self.args.phase}.json"), "w") as f:
            json.dump({"meta": self.meta(), "planned": self.args.only, "done": self.done,
                       "rows": self.rows}, f, indent=1)

    def meta(self) -> dict:
        paddle = self.paddle
        version = getattr(paddle, "version", None)

        def ask(fn):
            try:
                return str(fn())
            except Exception:  # an older or newer Paddle without it
                return "?"

        return {"world": self.world, "layout": "x".join(map(str, self.layout)),
                "steps": self.args.steps, "paddle": paddle.__version__,
                "cuda": ask(lambda: version.cuda()), "nccl": ask(lambda: version.nccl()),
                "gpu": ask(paddle.device.cuda.get_device_name)
                if not self.args.cpu_rehearsal else "CPU",
                "rehearsal": self.args.cpu_rehearsal,
                "tf32_override": os.environ.get("NVIDIA_TF32_OVERRIDE")}


def parity_row(name: str, full: dict, ref_params: dict, losses, ref_losses,
               bound: float, what: str) -> dict:
    """PASS when every parameter in both and the losses are within ``bound`` (the
    workers' measure, parity.max_rel: max |a - b| / max |b|)."""
    from parity import max_rel

    missing = sorted(set(ref_params) ^ set(full))
    diffs = {k: max_rel(full[k].numpy(), ref_params[k]) for k in ref_params if k in full}
    worst_key = max(diffs, key=diffs.get) if diffs else "-"
    params = diffs.get(worst_key, float("inf"))
    loss = max_rel(losses, ref_losses)
    ok = not missing and max(params, loss) <= bound
    figures = (f"losses {loss:.1e}, params {params:.1e} (worst {worst_key}) max rel vs "
               f"{what}; bound {bound:.0e}")
    if missing:
        figures += f"; keys not in both: {missing[:5]}"
    return row(name, "PASS" if ok else "FAIL", figures, losses=list(losses),
               reference_losses=list(ref_losses), params=diffs)


def check_layout(run: Run) -> list:
    import paddle_hsdp

    ref_losses, ref_params, _ = run.reference()
    rows = []
    for front, layout in (("fleet", run.layout), ("mesh", run.other)):
        kwargs = {} if front == "fleet" else {"mesh": run.mesh(layout)}
        model, opt = run.tinylm(**kwargs)
        losses = run.models.train_steps(model, opt, run.data(), run.rank, run.world, PER_RANK)
        full = paddle_hsdp.full_state_dict(model)
        rows.append(parity_row(f"layout {layout[0]}x{layout[1]} ({front})", full, ref_params,
                               losses, ref_losses, FP32_BOUND,
                               f"1 device, whole batch, fp32, {run.args.steps} steps"))
    return rows


def llama(run: Run, overlap: bool):
    """A Llama-shaped model sharded per decoder layer, its AdamW and a step function."""
    import numpy as np

    import bench_model
    import paddle_hsdp

    paddle = run.paddle
    shape = bench_model.SHAPES[run.args.shape]
    model = bench_model.build(shape)
    for layer in model.layers:
        paddle_hsdp.fully_shard(layer, enable_tensor_fusion_and_overlap=overlap)
    paddle_hsdp.fully_shard(model, enable_tensor_fusion_and_overlap=overlap)
    if not overlap:
        model.set_prefetch_count(forward=0, backward=0)
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    rng = np.random.default_rng(100 + run.rank)
    per_rank = 8 if not run.args.cpu_rehearsal else 2
    ids = [paddle.to_tensor(rng.integers(0, shape.vocab, size=(per_rank, shape.seq + 1)))
           for _ in range(4)]
    count = [0]

    def step():
        loss = bench_model.loss_of(model, ids[count[0] % len(ids)])
        loss.backward()
        opt.step()
        opt.clear_grad()
        count[0] += 1
        return loss

    return model, step


def _synchronize(run: Run) -> None:
    if not run.args.cpu_rehearsal:
        run.paddle.device.synchronize()


def timed(run: Run, step, steps: int) -> float:
    """Seconds per step over ``steps`` steps, from a barrier to the device going idle."""
    _synchronize(run)
    run.dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(run)
    return (time.perf_counter() - start) / steps


def check_overlap(run: Run) -> list:
    steps = 2 * run.args.steps
    steppers = {}
    for overlap in (True, False):
        _, steppers[overlap] = llama(run, overlap)
        for _ in range(2):  # warm-up: allocations, communicators, the recorded order
            steppers[overlap]()
    best = {True: math.inf, False: math.inf}
    for _ in range(TIMED_ROUNDS):
        for overlap in (True, False):
            best[overlap] = min(best[overlap], timed(run, steppers[overlap], steps))
    ratio = best[False] / best[True]
    figures = (f"on {best[True] * 1e3:.1f} ms/step, off {best[False] * 1e3:.1f} ms/step: "
               f"off/on {ratio:.2f}x ({run.args.shape} model, best of {TIMED_ROUNDS} x "
               f"{steps} steps; PASS at >= {SPEED_MIN})")
    return [row("overlap step time", "PASS" if ratio >= SPEED_MIN else "FAIL", figures,
                on_s=best[True], off_s=best[False], ratio=ratio)]


def check_profile(run: Run) -> list:
    name = "profile: comm under compute"
    if run.layout[1] == 1:
        return [row(name, "SKIP", "inner size 1: no all-gather or reduce-scatter to see")]
    trace_dir = os.path.join(run.out, "trace")
    _, step = llama(run, True)
    for _ in range(2):  # warm-up, outside the profiler: a failure here is the engine's
        step()
    try:
        import paddle.profiler as profiler

        prof = profiler.Profiler(
            targets=[profiler.ProfilerTarget.CPU, profiler.ProfilerTarget.GPU],
            scheduler=(1, 3),
            on_trace_ready=profiler.export_chrome_tracing(trace_dir,
                                                          worker_name=f"rank{run.rank}"))
        prof.start()
        for _ in range(4):
            step()
            prof.step()
        prof.stop()
        _synchronize(run)
    except Exception as e:  # a Paddle whose profiler API differs
        return [row(name, "SKIP", f"paddle.profiler failed: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}")]
    kernels, source = [], "profiler result"
    try:
        kernels = kernels_from_nodes(prof.profiler_result.get_data())
    except Exception as e:
        source = f"profiler result unreadable ({type(e).__name__}); chrome trace"
    traces = sorted(glob.glob(os.path.join(trace_dir, f"rank{run.rank}*.json")),
                    key=os.path.getmtime)
    if not kernels and traces:
        try:
            kernels, source = kernels_from_chrome_trace(traces[-1]), "chrome trace"
        except Exception as e:
            source = f"chrome trace unreadable ({type(e).__name__}: {e})"
    return [profile_row(name, overlap_report(kernels), source,
                        traces[-1] if traces else None)]


def profile_row(name: str, rep: dict, source: str, trace) -> dict:
    """PASS when reduce-scatter and all-gather kernels (or, if their names do not say,
    all NCCL kernels) spent at least OVERLAP_MIN of their time under compute kernels."""
    where = f"trace {trace}" if trace else "no trace file"
    if not rep.get("compute_kernels") and "nccl_all" not in rep:
        return row(name, "SKIP", f"no GPU kernels recorded ({source}); {where}", report=rep)
    if "nccl_all" not in rep:
        return row(name, "FAIL", f"{rep['compute_kernels']} compute kernels but no NCCL "
                                 f"kernel ({source}); {where}", report=rep)
    named = [k for k in ("reduce_scatter", "all_gather") if k in rep]
    judged = named or ["nccl_all"]
    parts = [f"{k} {rep[k]['overlapped']:.0%} of {rep[k]['time'] / 1e3:.2f} ms under compute "
             f"({rep[k]['count']} kernels, streams {','.join(rep[k]['streams'])})"
             for k in judged + [k for k in ("all_reduce", "nccl") if k in rep]]
    ok = all(rep[k]["overlapped"] >= OVERLAP_MIN for k in judged)
    return row(name, "PASS" if ok else "FAIL",
               "; ".join(parts) + f" (PASS at >= {OVERLAP_MIN:.0%}); {where}", report=rep)


def check_offload(run: Run) -> list:
    import paddle_hsdp

    data = run.data()
    base, base_opt = run.tinylm()
    base_losses = run.models.train_steps(base, base_opt, data, run.rank, run.world, PER_RANK)
    base_full = {k: v.numpy() for k, v in paddle_hsdp.full_state_dict(base).items()}
    model, opt = run.tinylm(offload_policy=paddle_hsdp.CPUOffloadPolicy(pin_memory=True))
    storage = {}

    def look(index):  # after the last step's opt.step(), before clear_grad
        if index == len(data) - 1:
            storage.update(storage_report(opt))

    losses = run.models.train_steps(model, opt, data, run.rank, run.world, PER_RANK,
                                    after_step=look)
    full = paddle_hsdp.full_state_dict(model)
    parity = parity_row("offload", full, base_full, losses, base_losses, FP32_BOUND,
                        "no offload")
    bad = storage["bad"]
    ok = parity["status"] == "PASS" and not bad
    figures = (f"{parity['figures']}; on a CPU place: {storage['params']} shards, "
               f"{storage['grads']} grads, {storage['accumulators']} accumulators; "
               f"{len(bad)} elsewhere{': ' + ', '.join(bad[:4]) if bad else ''}")
    if storage["no_grad"]:
        figures += f"; {storage['no_grad']} trainable shards without a grad"
    return [row("offload (pinned)", "PASS" if ok else "FAIL", figures,
                storage=storage, **parity["detail"])]


def check_bf16(run: Run) -> list:
    import numpy as np

    import paddle.nn.functional as F
    import paddle_hsdp

    paddle, models, rank = run.paddle, run.models, run.rank
    mp = paddle_hsdp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")
    curves, finite = {}, True
    for label, kwargs in (("fp32", {}), ("bf16", {"mp_policy": mp})):
        model, opt = run.tinylm(**kwargs)

        def micro_loss(micro, _, model=model):  # logits in float32 for the loss
            ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
            logits = model(ids[:, :-1], models.uses_extra(rank)).astype("float32")
            return F.cross_entropy(logits.reshape([-1, models.VOCAB]),
                                   ids[:, 1:].reshape([-1, 1]))

        curves[label] = run.common.train_loop(opt, run.data(), micro_loss,
                                              processes=run.world)
        full = paddle_hsdp.full_state_dict(model)
        finite &= all(np.isfinite(v.astype("float32").numpy()).all() for v in full.values())
    finite &= bool(np.isfinite(curves["bf16"]).all())
    diff = max(abs(a - b) / abs(b) for a, b in zip(curves["bf16"], curves["fp32"]))
    ok = finite and diff <= BF16_LOSS_BOUND
    figures = (f"losses max rel {diff:.1e} vs fp32 over {len(curves['fp32'])} steps (bound "
               f"{BF16_LOSS_BOUND:.0e}); {'no' if finite else 'SOME'} NaN/inf in losses and "
               f"params; last loss bf16 {curves['bf16'][-1]:.4f}, fp32 {curves['fp32'][-1]:.4f}")
    return [row("bf16 vs fp32", "PASS" if ok else "FAIL", figures, curves=curves)]


def _record_path(run: Run) -> str:
    return os.path.join(run.out, "results", f"mismatch.{run.args.phase}.rank{run.rank}.jsonl")


def _record(run: Run, rec: dict) -> None:
    with open(_record_path(run), "a") as f:
        f.write(json.dumps(dict(rec, rank=run.rank, time=time.time())) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _blocks_forward(order_of):
    """A TinyLM forward that runs the blocks in ``order_of(self)`` (indices, repeats
    allowed)."""
    def forward(self, ids, use_extra, inputs_embeds=None):
        x = self.embed(ids) + self.pos
        for i in order_of(self):
            x = self.blocks[i](x, use_extra)
        return self.head(self.final_norm(x))
    return forward


def mismatch_variant(run: Run, check: str, order: list, train: bool) -> None:
    """Run TinyLM with this rank's block ``order`` (eval forward, or a training step)
    and record what happened, with the seconds from the forward's start."""
    import paddle_hsdp
    from paddle_hsdp.comm import watchdog

    model, opt = run.tinylm()
    ids = run.paddle.to_tensor(run.data()[0][0][run.rank * PER_RANK:(run.rank + 1) * PER_RANK])
    cls = type(model)
    original = cls.forward
    cls.forward = _blocks_forward(lambda self: order)
    where = "forward"
    _record(run, {"check": check, "outcome": None, "order": order,
                  "bound": float(os.environ["PADDLE_HSDP_COLLECTIVE_TIMEOUT"])})
    start = time.perf_counter()
    try:
        if train:
            loss = run.models.lm_loss(model, ids, run.models.uses_extra(run.rank))
            where = "backward"
            loss.backward()
            where = "optimizer step"
            opt.step()
            opt.clear_grad()
        else:
            model.eval()
            with run.paddle.no_grad():
                model(ids[:, :-1], run.models.uses_extra(run.rank))
        with watchdog.host_sync("gpu_check: the device finishing the mismatched run"):
            _synchronize(run)  # a rank left waiting ends under the same bound
        outcome, message = "no error", "the ranks computed on each other's rows"
    except paddle_hsdp.CollectiveMismatchError as e:
        outcome, message = "CollectiveMismatchError", str(e).splitlines()[0]
    except Exception as e:
        outcome, message = type(e).__name__, (str(e).splitlines() or [""])[0]
    finally:
        cls.forward = original
    _record(run, {"check": check, "outcome": outcome, "where": where, "message": message,
                  "seconds": time.perf_counter() - start})


def _await_records(run: Run, check: str, limit: float) -> list:
    """Every rank's finished record of ``check`` (files in the out folder), waiting up
    to ``limit`` seconds for the others."""
    deadline = time.monotonic() + limit
    while True:
        recs = [r for r in read_records(run.out, run.args.phase) if r.get("check") == check]
        done = {r["rank"] for r in recs if r.get("outcome")}
        if len(done) == run.world or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def check_mismatch(run: Run) -> list:
    """Odd ranks run blocks 0, 2, 1, even ranks 0, 1, 2: the same all-gathers in count
    and size, of different units. On a fresh model (no recorded order, so no prefetch)."""
    rows = []
    order = [0, 2, 1] if run.rank % 2 else [0, 1, 2]
    for check, train in zip(MISMATCH_VARIANTS, (False, True)):
        mismatch_variant(run, check, order, train)
        recs = _await_records(run, check, 30)
        rows.append(summarise_mismatch(check, recs, run.world))
    return rows


def check_mismatch_hang(run: Run) -> list:
    """The last rank calls block 1 twice in an eval forward: one all-gather more than
    the others, which may leave a rank waiting until the watchdog ends it."""
    last = run.world - 1
    order = [0, 1, 1, 2] if run.rank == last else [0, 1, 2]
    mismatch_variant(run, HANG, order, train=False)
    return []  # built by --report from the records and worker logs


RUNNERS = {"layout": check_layout, "overlap": check_overlap, "profile": check_profile,
           "offload": check_offload, "bf16": check_bf16, "mismatch": check_mismatch,
           "mismatch_hang": check_mismatch_hang}


def run_checks(args) -> int:
    # Before CUDA starts: fp32 parity without TF32, and the bound the mismatch expects.
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    os.environ.setdefault("PADDLE_HSDP_COLLECTIVE_TIMEOUT", str(args.timeout))
    sys.path[:0] = [HERE, WORKERS]
    launched = "PADDLE_TRAINER_ID" in os.environ
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if args.cpu_rehearsal:
        if world < 2:
            _fail_fast("gpu_check --cpu-rehearsal: launch it on 2+ CPU ranks: python -m "
                       "paddle.distributed.launch --nproc_per_node 2 tools/gpu_check.py "
                       "--cpu-rehearsal")
        if args.shape == "73m":
            args.shape = "tiny"
    else:
        paddle = _import_paddle()
        problem = gpu_problem(paddle.is_compiled_with_cuda(),
                              paddle.device.cuda.device_count()
                              if paddle.is_compiled_with_cuda() else 0,
                              world, paddle.__version__, launched)
        if problem:
            _fail_fast(problem)
    if args.layout:
        try:
            parse_layout(args.layout, world)
        except ValueError as e:
            _fail_fast(f"gpu_check: {e}")
    run = Run(args)
    os.makedirs(os.path.join(run.out, "results"), exist_ok=True)
    if os.path.exists(_record_path(run)):
        os.remove(_record_path(run))  # this rank's records of an earlier run of this phase
    if args.cpu_rehearsal:  # the device paths, on CPU: the tests' switches
        from paddle_hsdp.comm import gather_tags
        from paddle_hsdp.engine import offload

        gather_tags.DEFER_ON_CPU = True  # tag flags read at the boundaries
        offload.EXERCISE_ON_CPU = True  # offload copies real, the CPU as the "device"
    if run.rank == 0:
        print(describe(run.meta()), flush=True)
    for name in args.only:
        started = time.perf_counter()
        try:
            new = RUNNERS[name](run)
        except Exception as e:
            text = (str(e).splitlines() or [""])[0][:300]
            new = [row(name, "FAIL", f"{type(e).__name__}: {text}")]
        for r in new:
            r["detail"]["seconds"] = round(time.perf_counter() - started, 2)
        run.add(name, new)
        if run.rank == 0:
            for r in new:
                print(f"[gpu_check] {r['check']}: {r['status']} {r['figures']}", flush=True)
    if run.rank == 0:
        print(format_table(run.rows, describe(run.meta())), flush=True)
        if "mismatch_hang" in args.only:
            print(f"mismatch_hang: python tools/gpu_check.py --report {run.out} merges the "
                  "ranks' records and the watchdog's lines", flush=True)
    if "mismatch_hang" not in args.only and "mismatch" not in args.only:
        run.dist.barrier()  # rank 0 owns the store; after a mismatch, no more collectives
    # 0 once the rows are written, FAILs included (--report's status counts them): a
    # launch that exits non-zero crashed.
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        rows, header = report(args.report)
        if not rows:
            print(f"gpu_check --report: no results under {args.report}", file=sys.stderr)
            return 1
        path = write_report(args.report, rows, header)
        print(format_table(rows, header))
        print(f"(written to {path})")
        return exit_status(rows)
    if args.preflight and args.cpu_rehearsal:
        print(2)  # the flags parsed; two CPU ranks
        return 0
    if args.preflight:
        paddle = _import_paddle()
        cuda = paddle.is_compiled_with_cuda()
        gpus = paddle.device.cuda.device_count() if cuda else 0
        problem = gpu_problem(cuda, gpus, 1, paddle.__version__)
        if problem:
            _fail_fast(problem)
        print(gpus)
        return 0
    return run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
