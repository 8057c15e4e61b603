"""The small tensor-parallel language model the mp workers share (worker_mp_pp.py,
worker_muon_3d.py): Paddle's mp layers (a vocab-parallel embedding, column- then
row-parallel linears per block, a head replicated over mp) and, with ``mp=False``, the
same model whole for the one-process reference; the mp model's weights are the mp
ranks' slices of the reference's."""

import numpy as np

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.meta_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                    VocabParallelEmbedding)

VOCAB, HIDDEN, FF, SEQ = 18, 8, 10, 6  # mp slices of 9 and 5 rows: padded for inner 2
STEPS, MICRO, PER_RANK = 4, 2, 2


class Block(nn.Layer):
    def __init__(self, mp: bool):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = (ColumnParallelLinear(HIDDEN, FF, gather_output=False, has_bias=True)
                   if mp else nn.Linear(HIDDEN, FF))
        self.down = (RowParallelLinear(FF, HIDDEN, input_is_parallel=True, has_bias=True)
                     if mp else nn.Linear(FF, HIDDEN))

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Layer):
    def __init__(self, mp: bool):
        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN) if mp else nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.LayerList([Block(mp), Block(mp)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)  # replicated over mp

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def full_weights(seed):
    """The reference's weights, in the default dtype."""
    rng = np.random.default_rng(seed)
    dtype = paddle.get_default_dtype()
    return {n: (0.5 * rng.standard_normal(p.shape)).astype(dtype)
            for n, p in Net(mp=False).named_parameters()}


def mp_slice(name, w, r, n):
    """mp rank ``r``'s part of the full weight: Column splits out, Row and vocab split rows."""
    if name.endswith("up.weight"):
        return np.split(w, n, axis=1)[r]
    if name.endswith(("up.bias", "down.weight")) or name == "embed.weight":
        return np.split(w, n, axis=0)[r]
    return w  # LayerNorm, Row bias, head: replicated


def build(mp, weights, r=0, n=1):
    model = Net(mp)
    for name, p in model.named_parameters():
        p.set_value(mp_slice(name, weights[name], r, n))
    return model


def batches(seed, n):
    """``STEPS`` steps of ``MICRO`` micro-batches of ``n * PER_RANK`` rows."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, size=(n * PER_RANK, SEQ + 1)).astype("int64")
             for _ in range(MICRO)] for _ in range(STEPS)]


def lm_loss(model, ids):
    ids = paddle.to_tensor(ids)
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape([-1, VOCAB]), ids[:, 1:].reshape([-1, 1]))
