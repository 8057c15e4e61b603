"""Measure the float noise floor of the tests' parity references (one process, ~20 s).

A sharded run and its single-process reference compute the same math; they may differ
only in float order (per-rank losses summed in another order, grads summed rank by rank, parameters stored as views of one flat buffer). The noise floor is how far the
reference drifts from itself under such reorderings alone: the smallest bound a parity
check can honestly use. The tests' bounds (test_collective/workers/parity.py) are this
floor times a stated margin; rerun this when the models, data or Paddle change.

    PYTHONPATH=test_collective/workers .venv/bin/python tools/noise_floor.py [--steps 5]

(test_collective/workers: TinyLM, its data and the reference trainer's pieces.)
"""

from __future__ import annotations

import argparse

import numpy as np
import paddle

from pythonpath import WORKERS, require

require("noise_floor", WORKERS, ("models", "common"),
        f"PYTHONPATH={WORKERS} .venv/bin/python tools/noise_floor.py")

import models  # noqa: E402  (TinyLM, its data and the reference trainer's pieces)
from common import max_rel, train_loop  # noqa: E402


def as_flat_views(model) -> None:
    """Store every parameter as a view of one flat buffer, as the engine's shards are."""
    params = list(model.parameters())
    flat = paddle.concat([p.detach().reshape([-1]) for p in params])
    start = 0
    for p in params:
        end = start + int(np.prod(p.shape))
        shape = list(p.shape)
        flat._slice(start, end)._share_buffer_to(p)
        p.get_tensor()._set_dims(shape)
        start = end
    model._flat_keepalive = flat


def train(data, n_ranks, per_rank, clip, reverse: bool, flat: bool, per_rank_backward=False):
    model = models.build_model()
    if flat:
        as_flat_views(model)
    opt = models.make_optimizer(model, model.parameters(), clip)
    order = list(range(n_ranks))[::-1] if reverse else list(range(n_ranks))

    def micro_loss(micro, _):
        loss = 0.0
        for r in order:
            ids = paddle.to_tensor(micro[r * per_rank:(r + 1) * per_rank])
            rank_loss = models.lm_loss(model, ids, models.uses_extra(r)) / n_ranks
            if per_rank_backward:  # grads accumulated rank by rank, as data parallel sums them
                (rank_loss / len(data[0])).backward()
                rank_loss = rank_loss.detach()
            loss = loss + rank_loss
        if per_rank_backward:  # train_loop's backward then adds nothing more
            loss = loss.detach()
            loss.stop_gradient = False
        return loss

    losses = train_loop(opt, data, micro_loss)
    return losses, {n: p.numpy() for n, p in model.state_dict().items()}


def spread(base, other) -> float:
    worst = max_rel(np.array(other[0]), np.array(base[0]))
    return max([worst] + [max_rel(other[1][n], base[1][n]) for n in base[1]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(f"paddle {paddle.__version__}; TinyLM, {args.steps} steps x 2 micro-steps, "
          "AdamW, clip 0.2; max relative difference over losses and every parameter")
    for dtype in ("float64", "float32"):
        paddle.set_default_dtype(dtype)
        for n_ranks in (2, 4, 8):
            data = models.batches(args.steps, 2, n_ranks, 2)
            base = train(data, n_ranks, 2, 0.2, reverse=False, flat=False)
            rows = {"reversed rank order": train(data, n_ranks, 2, 0.2, True, False),
                    "flat-buffer views": train(data, n_ranks, 2, 0.2, False, True),
                    "per-rank backward": train(data, n_ranks, 2, 0.2, False, False, True),
                    "both": train(data, n_ranks, 2, 0.2, True, True)}
            cells = ", ".join(f"{k} {spread(base, v):.2e}" for k, v in rows.items())
            print(f"{dtype} {n_ranks} ranks: {cells}", flush=True)


if __name__ == "__main__":
    main()
