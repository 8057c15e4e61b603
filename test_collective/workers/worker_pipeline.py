"""HSDP inside Paddle's pipeline schedule (issue 32): a ``PipelineLayer`` trained with
``fleet.distributed_model(...).train_batch`` (1F1B, accumulate_steps 4) on CPU ranks,
against one process on the global batch.

The model: an embedding of 37 rows, 4 blocks (LayerNorm, 8 -> 25 -> 8 MLP: row counts
the inner size does not divide) and a head (LayerNorm, linear), 2 stages; every block
of a stage is a ``fully_shard`` unit and the ``PipelineLayer`` the root (it holds the
stage's embedding or head). Each sharding rank trains on its own rows of the step's
global batch; ``train_batch`` cuts them into 4 micro-batches. The reference: the same
layers in one sequential model, the mean loss over the sharding ranks' rows per
micro-batch, averaged over micro-batches, the same AdamW.

Runs (argv JSON: a layout for common.init_fleet, with ``pipeline_configs``):
* float64 and float32, with ``ClipGradByGlobalNorm`` active at every step: every final
  parameter of the stage, the loss ``train_batch`` returns (broadcast from the last
  stage in its dtype: the final-loss shim) and the pre-clip global norm of every step,
  within workers/parity.py's bound of the dtype. Fleet's optimizer installs Paddle's
  ``HybridParallelClipGrad``, which sums float16, bfloat16 and float32 grads only; on
  HSDP shards paddle_hsdp replaces it by its own clip, so float64 grads are clipped too
  (with Paddle's, the float64 run would miss the reference);
* with a work dir, the float64 run saves after step SAVE_AT and resumes there (the
  last step bit-identical) and, in a later run of this worker at pp1 x sharding4, in
  one stage.
Both count the outer all-reduces of each step: one per trainable buffer. First, a
``PipelineLayer`` built without fleet's ``topology`` is refused on every rank.
"""

import os

import numpy as np
from common import (assert_same_params, compare_with_reference, config_from_argv, finish,
                    init_fleet, max_rel, report_over, train_loop)
import parity

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry

VOCAB, HIDDEN, FF, SEQ, BLOCKS = 37, 8, 25, 6, 4
STEPS, CLIP, LR = 3, 0.3, 0.02
SAVE_AT = 2  # with a work dir, the float64 run saves after this step


class Embed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids):
        return self.embedding(ids)


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FF)
        self.fc2 = nn.Linear(FF, HIDDEN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Head(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


LAYERS = [Embed] + [Block] * BLOCKS + [Head]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1]))


class Sequential(nn.Layer):
    """The reference: the pipeline's layers in one model, named as PipelineLayer names
    them (``<global layer index>.<param>``)."""

    def __init__(self):
        super().__init__()
        self.layers = [cls() for cls in LAYERS]
        for i, layer in enumerate(self.layers):
            self.add_sublayer(str(i), layer)

    def forward(self, ids):
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x


def full_weights() -> dict:
    rng = np.random.default_rng(5)
    return {n: (0.4 * rng.standard_normal(p.shape)).astype(paddle.get_default_dtype())
            for n, p in Sequential().named_parameters()}


def batches(n: int, rows: int) -> list:
    """``[step] -> (ids, labels)`` of the global batch, ``n`` sharding ranks x ``rows``."""
    rng = np.random.default_rng(9)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, VOCAB, size=(n * rows, SEQ + 1)).astype("int64")
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


@paddle.no_grad()
def clip_like_paddle(params) -> float:
    """ClipGradByGlobalNorm's clipping, in place: returns the pre-clip norm."""
    norm = sum(float((p.grad.astype("float64") ** 2).sum()) for p in params) ** 0.5
    scale = CLIP / max(norm, CLIP)
    for p in params:
        p.grad.scale_(scale)
    return norm


def train_reference(weights, data, n, micro, mbs, clip):
    model = Sequential()
    model.set_state_dict(weights)
    opt = paddle.optimizer.AdamW(learning_rate=LR, parameters=model.parameters())
    losses, norms = [], []
    rows = micro * mbs
    for ids, labels in data:
        total = 0.0
        for m in range(micro):
            parts = [slice(d * rows + m * mbs, d * rows + (m + 1) * mbs) for d in range(n)]
            loss = sum(loss_fn(model(paddle.to_tensor(ids[s])), paddle.to_tensor(labels[s]))
                       for s in parts) / n
            (loss / micro).backward()
            total += float(loss) / micro
        if clip:
            norms.append(clip_like_paddle(model.parameters()))
        opt.step()
        opt.clear_grad()
        losses.append(total)
    if clip:
        assert min(norms) > CLIP, norms  # clipping is active at every step
    return losses, norms, {k: v.numpy() for k, v in model.state_dict().items()}


def build_pipeline(hcg, weights):
    model = PipelineLayer(layers=[LayerDesc(cls) for cls in LAYERS],
                          num_stages=hcg.get_pipe_parallel_world_size(),
                          topology=hcg.topology(), loss_fn=loss_fn)
    for name, p in model.named_parameters():
        p.set_value(weights[name])
    for layer in model.run_function:
        if isinstance(layer, Block):
            paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    return model


def outer_buffers(model) -> int:
    return sum(1 for unit in hsdp_registry.units_under(model) for b in unit.buffers
               if b.trainable)


def make_opt(model, clip=False):
    grad_clip = paddle.nn.ClipGradByGlobalNorm(CLIP) if clip else None
    return paddle.optimizer.AdamW(learning_rate=LR, parameters=model.parameters(),
                                  grad_clip=grad_clip)


def train_pipeline(hcg, model, data, rows, clip, opt=None, after_step=None):
    """``train_batch`` on each step of ``data``; ``after_step(index, optimizer)`` after
    each. Returns the losses, the pre-clip norms (with ``clip``) and each step's count
    of outer all-reduces."""
    sharding = hcg.get_sharding_parallel_group()
    d, n = hcg.get_sharding_parallel_rank(), sharding.nranks
    opt = make_opt(model, clip) if opt is None else opt
    pipe, opt = fleet.distributed_model(model), fleet.distributed_optimizer(opt)
    losses, norms, outer_calls = [], [], []
    reduces = []  # inner reduce-scatters per step
    for index, (ids, labels) in enumerate(data):
        reduced = comm.counter.get("inner", "reduce_scatter").calls
        before = comm.counter.get("outer", "all_reduce").calls
        mine = slice(d * rows, (d + 1) * rows)
        loss = pipe.train_batch([paddle.to_tensor(ids[mine]), paddle.to_tensor(labels[mine])],
                                opt)
        outer_calls.append(comm.counter.get("outer", "all_reduce").calls - before)
        reduces.append(comm.counter.get("inner", "reduce_scatter").calls - reduced)
        t = loss.reshape([1]).astype("float64")
        comm.all_reduce(t, sharding, tag="log")
        losses.append(t.item() / n)
        if clip:
            norms.append(paddle_hsdp.last_global_norm(opt))
        if after_step is not None:
            after_step(index, opt)
    accumulate = pipe.accumulate_steps
    trainable = outer_buffers(model)
    # one reduce-scatter per buffer per micro-batch (1F1B runs a micro-batch's forward
    # before the previous one's backward: an extra one per unit was the bug)
    assert reduces == [trainable * accumulate] * len(data), (reduces, trainable, accumulate)
    return losses, norms, outer_calls


def run(hcg, layout, dtype, clip):
    parity.set_dtype(dtype)
    micro = layout["pipeline_configs"]["accumulate_steps"]
    mbs = layout["pipeline_configs"]["micro_batch_size"]
    n = hcg.get_sharding_parallel_world_size()
    weights, data = full_weights(), batches(n, micro * mbs)
    ref_losses, ref_norms, ref_params = train_reference(weights, data, n, micro, mbs, clip)
    model = build_pipeline(hcg, weights)
    # with a work dir, the float64 run saves the checkpoint of step SAVE_AT (resumed below)
    save = saver(layout["work"], model) if "work" in layout and dtype == "float64" else None
    losses, norms, outer_calls = train_pipeline(hcg, model, data, micro * mbs, clip,
                                                after_step=save)
    buffers = outer_buffers(model) if hcg.get_fsdp_outer_degree() > 1 else 0
    assert outer_calls == [buffers] * STEPS, (outer_calls, buffers)
    worst = {}
    full = paddle_hsdp.full_state_dict(model)
    for name, value in full.items():
        worst[name] = max_rel(value.numpy(), ref_params[name])
    worst["loss"] = max_rel(losses, ref_losses)
    if clip:
        worst["norm"] = max_rel(norms, ref_norms)
    label = (f"PIPELINE {dtype}{' clipped' if clip else ''} pp{hcg.get_pipe_parallel_world_size()}"
             f" sharding{n} outer{hcg.get_fsdp_outer_degree()}")
    both = report_over(hcg.get_pipe_parallel_group(), label, worst)  # every stage's
    print(f"{label}: max rel diff {both:.2e} over the stages (stage {hcg.get_stage_id()}: "
          f"loss {worst['loss']:.2e}); {buffers} outer all-reduces per step", flush=True)
    if save is not None:
        resume_same_layout(hcg, layout, model, data, micro * mbs, losses, clip)


def saver(work: str, model):
    def save(index, opt):
        if index == SAVE_AT - 1:
            checkpoint.save_checkpoint(os.path.join(work, "pipeline_ckpt"), model, opt,
                                       extra={"step": SAVE_AT})
    return save


def other_weights() -> dict:
    """Weights unlike the saved ones: a load must replace every one."""
    return {k: v[::-1].copy() for k, v in full_weights().items()}


def resume_same_layout(hcg, layout, model, data, rows, losses, clip) -> None:
    """The checkpoint of step SAVE_AT in the layout that saved it: the last steps and
    every final parameter bit-identical to the uninterrupted run."""
    resumed = build_pipeline(hcg, other_weights())
    opt = make_opt(resumed, clip)
    extra = checkpoint.load_checkpoint(os.path.join(layout["work"], "pipeline_ckpt"), resumed,
                                       opt)
    assert extra == {"step": SAVE_AT}, extra
    again, _, _ = train_pipeline(hcg, resumed, data[SAVE_AT:], rows, clip, opt=opt)
    assert again == losses[SAVE_AT:], (again, losses[SAVE_AT:])
    assert_same_params(resumed, model)
    print(f"PIPELINE checkpoint pp{hcg.get_pipe_parallel_world_size()}: resumed in the same "
          "layout, bit-identical", flush=True)


def resume_in_one_stage(hcg, saved: dict) -> None:
    """The float64 run's checkpoint (saved at ``saved``'s layout: pp2) in this layout, one
    stage (``PipelineLayer(num_stages=1)`` sharded over every rank, trained by plain
    forward and backward): the last steps against the one-process reference."""
    parity.set_dtype("float64")
    micro = saved["pipeline_configs"]["accumulate_steps"]
    mbs = saved["pipeline_configs"]["micro_batch_size"]
    n_saved, n = saved["sharding_degree"], hcg.get_sharding_parallel_world_size()
    data = batches(n_saved, micro * mbs)
    ref_losses, _, ref_params = train_reference(full_weights(), data, n_saved, micro, mbs,
                                                True)
    model = build_pipeline(hcg, other_weights())
    opt = make_opt(model, clip=True)
    extra = checkpoint.load_checkpoint(os.path.join(saved["work"], "pipeline_ckpt"), model, opt)
    assert extra == {"step": SAVE_AT}, extra
    per = n_saved * micro * mbs // n
    mine = slice(hcg.get_sharding_parallel_rank() * per, (hcg.get_sharding_parallel_rank() + 1) * per)
    losses = train_loop(opt, [[step] for step in data[SAVE_AT:]],
                        lambda step, _: loss_fn(model(paddle.to_tensor(step[0][mine])),
                                                paddle.to_tensor(step[1][mine])), n)
    worst = compare_with_reference("pipeline checkpoint pp2 -> pp1", {
        k: v for k, v in paddle_hsdp.full_state_dict(model).items()}, ref_params, losses,
        ref_losses[SAVE_AT:], {})
    print(f"PIPELINE checkpoint pp{saved['pp_degree']} -> pp1 sharding{n} "
          f"outer{hcg.get_fsdp_outer_degree()}: max rel diff {worst:.2e}", flush=True)


def refuses_its_own_topology(hcg) -> None:
    """Without ``topology=``, PipelineLayer's data-major stages are not fleet's (the
    sharding axis sits inside the pipeline axis): refused here, on every rank."""
    try:
        PipelineLayer(layers=[LayerDesc(cls) for cls in LAYERS],
                      num_stages=hcg.get_pipe_parallel_world_size(), loss_fn=loss_fn)
    except ValueError as e:
        assert "topology=fleet.get_hybrid_communicate_group().topology()" in str(e), e
    else:
        raise AssertionError("a PipelineLayer with stages other than fleet's was accepted")
    print("PIPELINE without topology= refused on every rank", flush=True)


config = config_from_argv()
hcg = init_fleet(config)
if "resume" in config:
    resume_in_one_stage(hcg, config["resume"])
else:
    refuses_its_own_topology(hcg)
    for dtype in ("float64", "float32"):
        run(hcg, config, dtype, clip=True)
paddle.set_default_dtype("float32")
finish()
