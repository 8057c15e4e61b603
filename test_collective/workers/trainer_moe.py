"""The project's own expert-parallel model for PaddleFormers' Trainer (issue 34): the
PaddleFormers MoE models tried import ``paddlefleet`` and do not build on CPU.

A tiny causal LM (embedding, a dense block, an MoE layer of ``LOCAL_EXPERTS`` experts
per expert-parallel rank, a head) whose experts route locally (no all-to-all): a
sample's tokens go to the experts of its ``expert_set``, local expert 1 for token ids
divisible by 3, else 0. With expert parallelism a rank holds its set's experts only;
the data give each sample the set of the rank that reads it (:class:`MoEData`, with
the Trainer's sampler unshuffled), so the one-process model, which holds every expert,
computes the same function. The distributed model checks that every sample it gets
is its own set's (a wrong assumption about the sampler fails loudly).
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

import paddle_hsdp

from moe_model import H, LOCAL_EXPERTS, VOCAB, Expert  # the MoE workers' expert

SEQ, EP = 6, 2
CLIP = 0.2  # below every step's pre-clip norm (0.32 to 0.38): clipping is active


class MoELM(nn.Layer):
    """``ep_rank`` None: every expert (one process); else this rank's set only."""

    def __init__(self, ep_rank=None, ep=EP):
        super().__init__()
        paddle.seed(5)
        self.embed = nn.Embedding(VOCAB, H)
        self.block = nn.Linear(H, H)
        self.gate = nn.Linear(H, H)
        built = [Expert() for _ in range(ep * LOCAL_EXPERTS)]  # alike on every rank
        keep = list(range(len(built))) if ep_rank is None else \
            list(range(ep_rank * LOCAL_EXPERTS, (ep_rank + 1) * LOCAL_EXPERTS))
        self.experts = nn.LayerList([built[i] for i in keep])
        self.head = nn.Linear(H, VOCAB)
        self.ep_rank = ep_rank
        paddle_hsdp.mark_expert_params(self.experts, global_indices=keep)

    def forward(self, input_ids, labels=None, expert_set=None):
        ids = input_ids[:, :-1]
        x = self.embed(ids)
        x = x + F.gelu(self.block(x))
        x = x + self.gate(x)
        rows_of = paddle.arange(ids.shape[0]).unsqueeze(1).expand(ids.shape).reshape([-1])
        sets = paddle.gather(expert_set.reshape([-1]), rows_of)
        if self.ep_rank is not None:
            assert bool((expert_set == self.ep_rank).all()), (
                f"a sample of another expert set reached ep rank {self.ep_rank}: "
                f"{expert_set.numpy().tolist()}")
            sets = paddle.zeros_like(sets)  # the local experts are the set's
        flat = x.reshape([-1, H])
        out = paddle.zeros_like(flat)
        choice = (ids.reshape([-1]) % 3 == 0).astype("int64")
        for i, expert in enumerate(self.experts):
            rows = paddle.nonzero((sets * LOCAL_EXPERTS + choice) == i).reshape([-1])
            if rows.shape[0] > 0:  # an expert with no tokens does not run at all
                out = paddle.scatter(out, rows, expert(paddle.gather(flat, rows)))
        logits = self.head(x + out.reshape(x.shape))
        loss = F.cross_entropy(logits.reshape([-1, VOCAB]),
                               input_ids[:, 1:].reshape([-1, 1]))
        return (loss, logits)


class MoEData(paddle.io.Dataset):
    """``n`` samples; sample ``i``'s ``expert_set`` is the expert-parallel rank of the
    data rank that reads it when ``world`` ranks read them unshuffled: PaddleFormers'
    sampler deals samples out interleaved (rank ``r`` reads ``r, r + world, ...``), and
    rank ``r``'s expert-parallel rank is ``r % ep``."""

    def __init__(self, n, seed, world, ep=EP):
        rng = np.random.RandomState(seed)
        self.x = rng.randint(0, VOCAB, size=(n, SEQ)).astype("int64")
        self.sets = (np.arange(n) % world % ep).astype("int64")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i], "expert_set": self.sets[i:i + 1]}
