"""The mismatch checks: ranks running TinyLM's blocks in different orders (``mismatch``:
same sizes, another order; ``mismatch_hang``: one call more), each rank recording what
happened for mismatch_outcomes to judge."""

from __future__ import annotations

import json
import os
import time

from gpucheck.mismatch_outcomes import (HANG, MISMATCH_VARIANTS, read_records,
                                         summarise_mismatch)
from gpucheck.run import PER_RANK, Run, synchronize


def record_path(run: Run) -> str:
    return os.path.join(run.out, "results", f"mismatch.{run.args.phase}.rank{run.rank}.jsonl")


def _record(run: Run, rec: dict) -> None:
    with open(record_path(run), "a") as f:
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
            synchronize(run)  # a rank left waiting ends under the same bound
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
