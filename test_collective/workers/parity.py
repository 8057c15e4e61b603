"""How far a sharded run may be from its reference, and why: the tests' parity bounds.

[Note: parity bounds] A sharded run and its independent reference (single-process
training on the whole batch, or the same model unsharded) compute the same math; they
may differ only in float order (per-rank losses summed in another order, grads summed
rank by rank and inner then outer, parameters stored as views of one flat buffer). The
noise floor is how far the reference drifts from itself when only that order changes;
``tools/noise_floor.py`` measures it (per-rank losses summed in reverse, grads
accumulated rank by rank, parameters as flat-buffer views). A bound is the worst floor
times a stated margin, never one run's result plus a notch.

Measured 2026-12-01 on this project's CI machine kind (x86-64, 2 cores, Paddle 3.3.1 CPU),
TinyLM, 5 steps x 2 micro-steps, AdamW, clipping active; worst over losses and every
parameter, relative to each tensor's largest value:

| dtype   | worst floor at 2 / 4 / 8 ranks | bound | margin over the worst floor |
|---------|--------------------------------|-------|-----------------------------|
| float64 | 7.0e-16 / 2.3e-15 / 5.4e-15    | 1e-10 | ~2e4                        |
| float32 | 1.0e-6 / 2.0e-6 / 1.2e-6       | 3e-5  | 15                          |

Parity checks run in float64 by default: the bound is five orders of magnitude tighter
than float32's, catches errors float32 would hide, and still never fails at random
(gloo reduces float64; every op the test models use has a float64 CPU kernel). Each
path keeps at least one float32 check, the dtype users train in.

Each check prints one ``PARITY_CHECK {json}`` line; the launcher collects them and the
test session prints every check's margin (bound / measured) at its end, so a sweep over
several runs shows which bound is close to its floor.
"""

from __future__ import annotations

import json

import numpy as np
import paddle

BOUNDS = {"float64": 1e-10, "float32": 3e-5}
# fleet.distributed_optimizer's HybridParallelClipGrad sums fp16, bf16 and fp32 grads
# only (Paddle 3.3.1, hybrid_parallel_optimizer.py): float64 grads would not count in
# its global norm. paddle_hsdp replaces it by its own clip on HSDP shards (every dtype);
# the checks written before that run in float32, those after (the Trainer's 3D runs) in
# float64.
FLEET_OPTIMIZER_DTYPE = "float32"


def set_dtype(dtype: str) -> str:
    """Build every later parameter in ``dtype`` (the models take the default dtype)."""
    if dtype not in BOUNDS:
        raise ValueError(f"parity dtype must be one of {sorted(BOUNDS)}, got {dtype!r}")
    paddle.set_default_dtype(dtype)
    return dtype


def bound(dtype: str | None = None) -> float:
    return BOUNDS[dtype or paddle.get_default_dtype()]


def max_rel(a, b) -> float:
    """Largest absolute difference, relative to the reference tensor's largest value."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def record(name: str, worst: dict, limit: float | None = None) -> dict:
    """Print check ``name``'s PARITY_CHECK line (``worst``: entry -> measured max_rel)
    and return the entries over ``limit`` (default: the current default dtype's bound)."""
    limit = bound() if limit is None else limit
    measured = max(worst.values()) if worst else 0.0
    line = {"name": name, "dtype": paddle.get_default_dtype(), "measured": measured,
            "bound": limit}
    print("PARITY_CHECK " + json.dumps(line), flush=True)
    return {k: v for k, v in worst.items() if not v <= limit}


def report(name: str, worst: dict, limit: float | None = None) -> float:
    """:func:`record` check ``name`` and fail it when any entry exceeds the bound;
    returns the worst difference."""
    bad = record(name, worst, limit)
    assert not bad, f"{name}: parity failed (bound {bound() if limit is None else limit:.0e}): {bad}"
    return max(worst.values()) if worst else 0.0


def assert_close(got, want, what: str = "") -> None:
    """One tensor (or list of losses) within the current default dtype's bound of the
    reference ``want``, measured as the workers measure (:func:`max_rel`)."""
    worst = max_rel(got, want)
    assert worst <= bound(), f"{what}: max rel diff {worst:.2e} over the bound {bound():.0e}"
