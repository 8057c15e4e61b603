"""The multi-process tier's session report: every parity check's margin.

Each parity check in a worker prints its measured difference and its bound
(workers/parity.py); the launcher collects them. At the end of the run this prints the
checks closest to their bounds, and with ``HSDP_PARITY_LOG=FILE`` appends every record
to FILE as JSON lines, so several runs can be compared (a flakiness sweep).
"""

import json
import os

from launcher import PARITY_RECORDS


def pytest_terminal_summary(terminalreporter):
    if not PARITY_RECORDS:
        return
    path = os.environ.get("HSDP_PARITY_LOG")
    if path:
        with open(path, "a") as f:
            for record in PARITY_RECORDS:
                f.write(json.dumps(record) + "\n")

    def margin(r):
        return r["bound"] / r["measured"] if r["measured"] > 0 else float("inf")

    rows = sorted(PARITY_RECORDS, key=margin)
    write = terminalreporter.write_line
    write(f"parity checks: {len(rows)}; the 8 closest to their bounds (margin = bound / measured):")
    for r in rows[:8]:
        write(f"  {margin(r):10.3g}x  {r['measured']:.2e} of {r['bound']:.0e} "
              f"{r['dtype']:8s} {r['name']}  [{r['test']}]")
