"""The tiny PaddleFormers ``LlamaForCausalLM`` of the 3D workers (worker_tp_llama.py,
worker_tp_checkpoint.py, single_process_3d.py) and what they do with it alike.

Untied embeddings, 2 layers, hidden 32, 4 heads (2 KV heads), vocabulary 64, so
tensor parallelism 2 splits every projection, the embedding and the head. Losses are
computed from the model's logits (in the default dtype: float64 keeps its precision;
PaddleFormers' own criterion casts to float32), through ``ParallelCrossEntropy`` on
vocabulary-split logits or ``F.cross_entropy`` on whole ones.

[Note: the Llama's float32 islands] Even in float64 PaddleFormers' Llama rounds to
float32 inside: the RMSNorm's variance (``hidden_states.astype("float32")``) and the
rotary embedding (``q.astype("float32") * cos``). A float64 difference in the last bit
that reaches such a cast can move the float32 value by one of its ulps (6e-8). Data
parallelism, and so HSDP, takes the mean over its N replicas by scaling the summed
grads by 1/N after backward; a one-process run that scales the loss by 1/N before
backward feeds the casts other bits unless N is a power of two (scaling by 2^-k is
exact). Measured on 3 replicas of 2 rows (plain data parallelism and HSDP alike, against
a one-process backward of all 6 rows with the loss divided first): 3.2e-7 relative in
the grads, 2.6e-8 in the pre-clip norms, up to 8.5e-6 in AdamW's parameters after 3
steps; on 2 replicas 3.8e-16 in the grads. So :func:`train`'s ``replicas`` takes the
mean where data parallelism does.
"""

from __future__ import annotations

import numpy as np

import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet.meta_parallel import ParallelCrossEntropy

from paddle_hsdp.comm import collectives as comm
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

SEQ, VOCAB, CLIP, LR = 8, 64, 0.5, 0.02
SGD_LR = 0.5  # plain SGD moves the tiny Llama too little at AdamW's rate


def config(mp: int = 1, mp_rank: int = 0, tpo: bool = True, sp: bool = False,
           intermediate: int = 64) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=intermediate,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQ, max_sequence_length=SEQ,
                       tie_word_embeddings=False, fuse_rms_norm=False,
                       tensor_model_parallel_size=mp, tensor_parallel_rank=mp_rank,
                       tensor_parallel_output=tpo, sequence_parallel=sp)


def llama(mp: int = 1, mp_rank: int = 0, tpo: bool = True, sp: bool = False,
          intermediate: int = 64):
    return LlamaForCausalLM(config(mp, mp_rank, tpo, sp, intermediate))


def full_weights(seed: int = 7) -> dict:
    """The one-process model's weights, ``{name: array}``, from ``seed``."""
    paddle.seed(seed)
    return {k: v.numpy() for k, v in llama().state_dict().items()}


def mp_slice(param, full: np.ndarray, mp: int, mp_rank: int) -> np.ndarray:
    """mp rank ``mp_rank``'s part of a full tensor, as Paddle's marks cut it."""
    if mp > 1 and getattr(param, "is_distributed", False):
        return np.split(full, mp, axis=param.split_axis)[mp_rank]
    return full


def set_slices(model, weights: dict, mp: int, mp_rank: int) -> None:
    for name, p in model.named_parameters():
        p.set_value(mp_slice(p, weights[name].astype(p.numpy().dtype), mp, mp_rank))


def logits_of(model, ids):
    out = model(input_ids=ids)
    return out[0] if isinstance(out, tuple) else out.logits


def lm_loss(model, ids, split_vocab: bool):
    ids = paddle.to_tensor(ids)
    logits, labels = logits_of(model, ids[:, :-1]), ids[:, 1:]
    if split_vocab:  # vocabulary-split logits: the c_softmax_with_cross_entropy path
        return ParallelCrossEntropy()(logits, labels.unsqueeze(-1)).mean()
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1]))


def make_opt(params, scheduler=None, kind: str = "adamw"):
    """AdamW (``kind="adamw"``) or plain SGD (``"sgd"``), global-norm clipping at CLIP."""
    clip = paddle.nn.ClipGradByGlobalNorm(CLIP)
    if kind == "sgd":
        return paddle.optimizer.SGD(learning_rate=SGD_LR if scheduler is None else scheduler,
                                    parameters=params, grad_clip=clip)
    assert kind == "adamw", kind
    return paddle.optimizer.AdamW(learning_rate=LR if scheduler is None else scheduler,
                                  parameters=params, weight_decay=0.01, grad_clip=clip)


def batches(rows: int, steps: int, micro: int, seed: int = 11) -> list:
    """``[step][micro-batch] -> ids [rows, SEQ + 1]`` of the global batch. Token 0 is the
    pad token, which the one-process embedding (padding_idx) skips and the
    vocabulary-parallel one does not (Paddle 3.3): the data never holds it."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(1, VOCAB, size=(rows, SEQ + 1)).astype("int64")
             for _ in range(micro)] for _ in range(steps)]


def grad_norm(params) -> float:
    return sum(float((p.grad ** 2).sum()) for p in params if p.grad is not None) ** 0.5


def train(model, opt, data, rows=None, group=None, split_vocab=False, scheduler=None,
          before_step=None, norm_of=None, replicas: int = 1):
    """One optimizer step per entry of ``data``: this process's ``rows`` (a slice; all of
    them by default) of each micro-batch, the loss backpropagated divided by the number
    of micro-batches; the losses logged as the mean over ``group`` (the data-parallel
    ranks, all-reduced for the log). Returns ``(losses, norms)``: ``norm_of(opt)`` after
    each step (the pre-clip global norm), or the plain grads' norm before it.

    ``replicas`` (the one-process reference of a data-parallel run on all rows): each
    micro-batch's rows are ``replicas`` equal blocks, one forward and backward each (the
    loss divided by the number of micro-batches, as each replica divides it), and the
    summed grads are divided by ``replicas`` before the step, where data parallelism
    takes the mean ([Note: the Llama's float32 islands])."""
    losses, norms = [], []
    n = 1 if group is None else group.nranks
    for micro_batches in data:
        total = 0.0
        for ids in micro_batches:
            ids = ids if rows is None else ids[rows]
            block = len(ids) // replicas
            for r in range(replicas):
                loss = lm_loss(model, ids[r * block:(r + 1) * block], split_vocab)
                (loss / len(micro_batches)).backward()
                value = float(loss)
                if n > 1:
                    t = paddle.to_tensor([value], dtype="float64")
                    comm.all_reduce(t, group, tag="log")
                    value = t.item()
                total += value / n / replicas / len(micro_batches)
        if replicas > 1:
            with paddle.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.scale_(1.0 / replicas)
        if before_step is not None:
            before_step()
        if norm_of is None:
            norms.append(grad_norm(model.parameters()))
        opt.step()
        if norm_of is not None:
            norms.append(norm_of(opt))
        opt.clear_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses, norms


def reference(weights: dict, data, scheduler_of=None, replicas: int = 1,
              kind: str = "adamw") -> dict:
    """The one-process run on the global batch: ``{"losses", "norms", "params"}``
    (``scheduler_of()``: a fresh LR scheduler, or a constant LR; ``replicas``: the
    data-parallel ranks whose rows the batch holds, see :func:`train`; ``kind``: the
    optimizer, see :func:`make_opt`)."""
    model = llama()
    model.set_state_dict(weights)
    scheduler = scheduler_of() if scheduler_of is not None else None
    opt = make_opt(model.parameters(), scheduler, kind)
    losses, norms = train(model, opt, data, scheduler=scheduler, replicas=replicas)
    return {"losses": losses, "norms": norms,
            "params": {k: v.numpy() for k, v in model.state_dict().items()}}
