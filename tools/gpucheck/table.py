"""A check's result is a row (check, PASS / FAIL / SKIP, its figures); the rows print as
one table, and any FAIL makes the exit status 1."""

from __future__ import annotations

from gpucheck.options import CHECKS

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
