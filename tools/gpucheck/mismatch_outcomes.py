"""The mismatch checks' outcomes: every rank's records (JSON lines under OUT/results) and
the watchdog's lines in the worker logs, judged into one row per variant."""

from __future__ import annotations

import glob
import json
import os
import re

from gpucheck.table import row

MISMATCH_VARIANTS = ("mismatch (eval forward)", "mismatch (training step)")
HANG = "mismatch_hang (extra call)"
# A rank left waiting by the extra call: on gloo its peer's exit fails the collective
# (CollectiveError naming the op); on NCCL nothing fails and the watchdog ends it.
HANG_OUTCOMES = ("CollectiveMismatchError", "CollectiveError")


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
