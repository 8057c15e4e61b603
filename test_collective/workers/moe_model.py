"""The small MoE language model the MoE workers share: each EP rank holds its own
experts and routes its own tokens locally (no all-to-all); on ranks with
``rank % 4 == 1`` local expert 1 never gets a token."""

import numpy as np

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from common import train_loop

VOCAB, H, SEQ, LOCAL_EXPERTS = 29, 8, 5, 2
STEPS, MICRO, PER_RANK, CLIP = 4, 2, 2, 0.1


class Expert(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, 2 * H + 1)
        self.fc2 = nn.Linear(2 * H + 1, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Layer):
    """``keep``: global ids of the experts this rank holds (all are built, for identical
    initialisation with the reference)."""

    def __init__(self, n_experts, keep):
        super().__init__()
        self.gate = nn.Linear(H, H)  # dense params in the same unit as the experts
        built = [Expert() for _ in range(n_experts)]
        self.experts = nn.LayerList([built[i] for i in keep])

    def forward(self, x, ids, ep_index):
        x = x + self.gate(x)
        flat, out = x.reshape([-1, H]), paddle.zeros([int(np.prod(x.shape[:-1])), H])
        choice = (ids.reshape([-1]) % 3 == 0).astype("int64")  # local expert 0 or 1
        experts = self.experts if ep_index is None else \
            self.experts[ep_index * LOCAL_EXPERTS:(ep_index + 1) * LOCAL_EXPERTS]
        for j, expert in enumerate(experts):
            rows = paddle.nonzero(choice == j).reshape([-1])
            if rows.shape[0] > 0:  # an expert with no tokens does not run at all
                out = paddle.scatter(out, rows, expert(paddle.gather(flat, rows)))
        return x + out.reshape(x.shape)


class Net(nn.Layer):
    """``moe``: the expert layer's class (``MoE``, or worker_muon_3d.py's 3-D stacks),
    built as ``moe(n_experts, keep)`` and called as ``moe(x, ids, ep_index)``."""

    def __init__(self, n_experts, keep, moe=MoE):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.block = nn.Linear(H, H)
        self.moe = moe(n_experts, keep)
        self.head = nn.Linear(H, VOCAB)

    def forward(self, ids, ep_index=None):
        x = self.embed(ids)
        x = x + F.gelu(self.block(x))
        return self.head(self.moe(x, ids, ep_index))


def loss_of(model, ids, ep_index=None):
    logits = model(ids[:, :-1], ep_index)
    return F.cross_entropy(logits.reshape([-1, VOCAB]), ids[:, 1:].reshape([-1, 1]))


def make_data(world):
    rng = np.random.default_rng(11)
    data = rng.integers(0, VOCAB, size=(STEPS, MICRO, world * PER_RANK, SEQ + 1))
    for r in range(world):
        if r % 4 == 1:  # this rank never routes a token to its local expert 1
            chunk = data[:, :, r * PER_RANK:(r + 1) * PER_RANK]
            chunk[chunk % 3 == 0] += 1
    return data.astype("int64")


def make_opt(model, clip):
    # epsilon 1e-6, not 1e-8: Adam divides each element by its own gradient scale, so an
    # element whose gradient is ~0 turns float32 rounding (1e-9 here, from the different
    # summation order of the distributed reduction) into a visible step; over a few
    # steps that reached 3e-5 relative on one expert with eps=1e-8 while every step's
    # grads matched the reference to 6e-8 at step 0.
    return paddle.optimizer.AdamW(0.05, parameters=model.parameters(), weight_decay=0.1,
                                  epsilon=1e-6, grad_clip=nn.ClipGradByGlobalNorm(clip))


def train_plain(model, opt, steps, world, ep, before_step=None):
    """Single-process training on the whole batch (every expert local): the reference."""
    def micro_loss(micro, _):
        return sum(loss_of(model, paddle.to_tensor(micro[r * PER_RANK:(r + 1) * PER_RANK]),
                           r % ep) for r in range(world)) / world

    return train_loop(opt, steps, micro_loss, before_step=before_step)


def train_sharded(model, opt, steps, rank, world, before_step=None, after_step=None):
    """This rank's share of each step; returns the global mean losses."""
    def micro_loss(micro, _):
        return loss_of(model, paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK]))

    return train_loop(opt, steps, micro_loss, processes=world, before_step=before_step,
                      after_step=after_step)
