"""The model, data and optimizer of the fault-tolerance test, shared by the replica
worker (worker_ft.py) and its single-process reference (single_process_ft.py)."""

import numpy as np
import paddle
from paddle import nn

import paddle_hsdp

SIZES = (8, 24, 24, 4)
BATCH = 3  # rows per rank and step
RANKS_PER_REPLICA = 2
CLIP = 0.05  # below every step's global norm here: the clip scales every step


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.layers = nn.LayerList([nn.Linear(a, b) for a, b in zip(SIZES, SIZES[1:])])

    def forward(self, x, middle_hook=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = paddle.tanh(x)
            if i == 1 and middle_hook is not None:
                x.register_hook(middle_hook)  # runs mid-backward
        return x


def build_model():
    paddle.seed(1234)
    return MLP()


def batch(step: int, replica: int, rank: int):
    """Step ``step``'s (0-based) rows of one rank of one replica."""
    rng = np.random.default_rng([step, replica, rank])
    x = rng.standard_normal((BATCH, SIZES[0]))
    y = rng.standard_normal((BATCH, SIZES[-1]))
    return x, y


def loss_of(model, x, y, middle_hook=None):
    out = model(paddle.to_tensor(x), middle_hook)
    return ((out - paddle.to_tensor(y)) ** 2).mean()


def penalty_of(model, weight: float):
    """``weight`` x the squared norm of ``model.parameters()``: a loss term on the
    parameters themselves (while sharded, on the shards the optimizer sees, so its
    value is each rank's part; its gradient must be plain data parallel's)."""
    return weight * paddle.add_n([(p * p).sum() for p in model.parameters()])


#: DiLoCo's outer optimizer in the runs that sync every H steps (FT_TEST_DILOCO=H)
DILOCO = {"lr": 0.7, "momentum": 0.9}

#: the optimizers a run can train with (worker_ft.py's FT_TEST_OPTIMIZER)
OPTIMIZERS = ("adamw", "muon")


def make_optimizer(params, kind: str = "adamw"):
    """``kind``: AdamW, or paddle_hsdp.Muon (its matrices owned by one rank each in a
    replica group: shard with :func:`placement`)."""
    scheduler = paddle.optimizer.lr.StepDecay(learning_rate=0.05, step_size=3, gamma=0.7)
    clip = paddle.nn.ClipGradByGlobalNorm(CLIP)
    if kind == "muon":
        opt = paddle_hsdp.Muon(learning_rate=scheduler, parameters=params, momentum=0.9,
                               weight_decay=0.01, grad_clip=clip)
    else:
        assert kind == "adamw", kind
        opt = paddle.optimizer.AdamW(learning_rate=scheduler, parameters=params,
                                     weight_decay=0.01, grad_clip=clip)
    return opt, scheduler


def placement(kind: str):
    """The ``shard_placement_fn`` of optimizer ``kind``."""
    return paddle_hsdp.owned_matrices() if kind == "muon" else None


def diffs_against(runs, want_losses, want_params_of):
    """``(loss diffs, param diffs)`` of every rank's results against a reference:
    ``want_losses[(step, replica, rank)]`` and ``want_params_of(run)``, the reference's
    parameters as of the step the run wrote its own at."""
    from parity import max_rel

    loss_diffs, param_diffs = {}, {}
    for run in runs:
        who = f"replica {run['replica']} rank {run['rank']}"
        for step, loss in run["losses"].items():
            want = want_losses[(int(step), run["replica"], run["rank"])]
            loss_diffs[f"{who} step {int(step) + 1}"] = abs(loss - want) / abs(want)
        want_params = want_params_of(run)
        assert sorted(run["params"]) == sorted(want_params), (sorted(run["params"]),
                                                              sorted(want_params))
        for name, value in run["params"].items():
            param_diffs[f"{who} {name}"] = max_rel(value, want_params[name])
    return loss_diffs, param_diffs
