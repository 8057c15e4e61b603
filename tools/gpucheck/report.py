"""``--report OUT``: every launch's rows under OUT merged into one table (with the
mismatch_hang row built from the records and logs, and a FAIL for each launch that
ended without its rows), the header describing the machine, OUT/gpu_check.json."""

from __future__ import annotations

import glob
import json
import os

from gpucheck.mismatch_outcomes import (HANG, HANG_OUTCOMES, read_records, summarise_mismatch,
                                         watchdog_lines)
from gpucheck.table import in_check_order, row


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
