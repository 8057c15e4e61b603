"""A tiny causal LM with every awkward parameter the engine must handle, and the
single-process reference trainer the multi-process runs are compared with.

- row counts not divisible by the inner size (embedding 37 rows, fc1 3h+1 rows);
- a frozen parameter (positional table, stop_gradient=True);
- a parameter used only on some ranks (``Block.extra``, gated by the data chunk);
- tied input/output embeddings through a second module (``TiedHead``);
- biases and norms, excluded from weight decay by name.
"""

from __future__ import annotations

import numpy as np

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from common import train_loop

VOCAB, HIDDEN, SEQ, LAYERS = 37, 8, 6, 3


class Block(nn.Layer):
    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 3 * h + 1)
        self.fc2 = nn.Linear(3 * h + 1, h)
        self.extra = self.create_parameter([h], default_initializer=nn.initializer.Normal(0, 0.1))

    def forward(self, x, use_extra: bool):
        y = self.fc2(F.gelu(self.fc1(self.norm(x))))
        if use_extra:
            y = y + self.extra
        return x + y


class TiedHead(nn.Layer):
    def __init__(self, embedding_weight):
        super().__init__()
        self.weight = embedding_weight  # the same parameter object: tied

    def forward(self, x):
        return paddle.matmul(x, self.weight, transpose_y=True)


class TinyLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = self.create_parameter([SEQ, HIDDEN])
        self.pos.stop_gradient = True  # frozen
        self.blocks = nn.LayerList([Block(HIDDEN) for _ in range(LAYERS)])
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.head = TiedHead(self.embed.weight)

    def forward(self, ids, use_extra: bool, inputs_embeds=None):
        x = (self.embed(ids) if inputs_embeds is None else inputs_embeds) + self.pos
        for block in self.blocks:
            x = block(x, use_extra)
        return self.head(self.final_norm(x))


def lm_loss(model, ids, use_extra):
    logits = model(ids[:, :-1], use_extra)
    return F.cross_entropy(logits.reshape([-1, VOCAB]), ids[:, 1:].reshape([-1, 1]))


def build_model(seed: int = 2024) -> TinyLM:
    paddle.seed(seed)
    return TinyLM()


def decay_filter(model):
    """Names that get weight decay: everything but biases and norms (by original name)."""
    names = {p.name for n, p in model.named_parameters()
             if not (n.endswith("bias") or "norm" in n)}
    return lambda name: name in names


def make_optimizer(model, parameters, clip_norm):
    clip = paddle.nn.ClipGradByGlobalNorm(clip_norm) if clip_norm else None
    return paddle.optimizer.AdamW(learning_rate=0.05, parameters=parameters,
                                  weight_decay=0.1, apply_decay_param_fun=decay_filter(model),
                                  grad_clip=clip)


def batches(steps: int, micro: int, n_ranks: int, per_rank: int, seed: int = 7):
    """``[step][micro] -> int64 array [n_ranks * per_rank, SEQ + 1]``; rank r takes rows
    ``r*per_rank:(r+1)*per_rank``."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, size=(n_ranks * per_rank, SEQ + 1)).astype("int64")
             for _ in range(micro)] for _ in range(steps)]


def uses_extra(rank: int) -> bool:
    return rank % 2 == 0  # Block.extra is unused on odd ranks


def train_reference(data, n_ranks, per_rank, clip_norm, seed=2024, before_step=None):
    """Single process, whole batch: the mean of every rank's chunk loss per micro-step,
    averaged over micro-steps, exactly what the distributed run should compute.
    ``before_step(model)``, if given, runs before each step and its result is the
    step's recorded norm (e.g. paddle.nn.utils.clip_grad_norm_)."""
    model = build_model(seed)
    opt = make_optimizer(model, model.parameters(), clip_norm)
    norms = []

    def record_norm(_):
        norms.append(global_norm(model) if before_step is None else before_step(model))

    def micro_loss(micro, _):
        loss = 0.0
        for r in range(n_ranks):
            ids = paddle.to_tensor(micro[r * per_rank:(r + 1) * per_rank])
            loss = loss + lm_loss(model, ids, uses_extra(r)) / n_ranks
        return loss

    losses = train_loop(opt, data, micro_loss, before_step=record_norm)
    return losses, {n: p.numpy() for n, p in model.state_dict().items()}, norms


def global_norm(model) -> float:
    """The global norm of ``model``'s grads (float64; parameters without one skipped):
    what a clip by the global norm sees."""
    sq = sum(float((p.grad.astype("float64") ** 2).sum()) for p in model.parameters()
             if p.grad is not None)
    return sq ** 0.5


def train_steps(model, opt, steps, rank, world, per_rank, after_step=None):
    """Train ``model`` on this rank's rows of each step's micro-batches (``steps``: a
    list of ``[micro] -> array``); return the loss of the whole batch per step (an
    all-reduce for the log, not through paddle_hsdp). ``after_step(step_index)`` runs
    between ``opt.step()`` and ``opt.clear_grad()``."""
    def micro_loss(micro, _):
        ids = paddle.to_tensor(micro[rank * per_rank:(rank + 1) * per_rank])
        return lm_loss(model, ids, uses_extra(rank))

    return train_loop(opt, steps, micro_loss, processes=world, after_step=after_step)


def train_on_chunks(model, opt, steps, chunks, per_rank, processes=1):
    """Train on the data chunks of the ranks in ``chunks`` (each micro-step's loss is
    their mean), e.g. two of a saved 4-rank run's chunks per rank on 2 ranks, or all of
    them in one process. Returns the whole batch's loss per step (all-reduced over the
    ``processes`` training together, for the log)."""
    def micro_loss(micro, _):
        return sum(lm_loss(model, paddle.to_tensor(micro[r * per_rank:(r + 1) * per_rank]),
                           uses_extra(r)) for r in chunks) / len(chunks)

    return train_loop(opt, steps, micro_loss, processes=processes)


def shard_tinylm(model, **kwargs):
    """The workers' layout: one unit for the embedding, one per block, then the root;
    ``kwargs`` go to every ``fully_shard`` call."""
    import paddle_hsdp

    for layer in [model.embed, *model.blocks]:
        paddle_hsdp.fully_shard(layer, **kwargs)
    paddle_hsdp.fully_shard(model, **kwargs)
    return model


def fragment_of(model, fragments):
    """Each trainable parameter's streaming-DiLoCo fragment (``OuterSyncPolicy
    (fragments=F)``), as the schedule says, not read from the engine: the units by the
    bytes of their trainable shards, largest first (ties: the lower index), each into
    the fragment holding the fewest bytes so far (ties: the lower fragment);
    ``{name: fragment}``, names as ``state_dict()``'s."""
    import numpy as np
    import paddle
    from paddle_hsdp.engine.registry import registry

    units = sorted(registry.units_under(model), key=lambda u: u.index)
    size = {u.index: sum(b.shard_numel * paddle.zeros([1], b.dtype).element_size()
                         for b in u.buffers if b.trainable) for u in units}
    held, where = np.zeros(fragments, dtype=np.int64), {}
    for unit in sorted(units, key=lambda u: (-size[u.index], u.index)):
        where[unit.index] = int(np.argmin(held))  # the first of the lightest
        held[where[unit.index]] += size[unit.index]
    return {registry.param_path(sp): where[unit.index] for unit in units
            for buf in unit.buffers if buf.trainable for sp in buf.params}
