"""Checkpoints and exports of a tensor-parallel PaddleFormers ``LlamaForCausalLM``
(issue 33), on 4 CPU ranks, against one process on the global batch.

Float64 (workers/parity.py's bound), AdamW with global-norm clipping and an
exponentially decaying LR (its scheduler state travels in the checkpoint):

* the uninterrupted run at mp2 x sharding2 outer 2 (STEPS steps) within the bound of the
  one-process reference (every final slice, every loss);
* the same run saves after step SAVE_AT; a model with other weights resumes from it
  (a) in the same layout: steps 3-4 and every final parameter bit-identical to the
  uninterrupted run; (b) at mp1 x sharding4 outer 2: within the bound of the reference
  (single_process_3d.py resumes it (c) in one process);
* Paddle's flex_checkpoint (``model.sharded_state_dict()``): each mp slice at its offset in
  the full tensor; a same-layout dcp round trip and the next step identical;
* a Llama with another intermediate size is refused on every rank, naming the first
  parameter whose full shape differs, with nothing changed.

Float32 (``from_pretrained`` has no float64): 2 steps at mp2 x sharding2 outer 2, then
``export_pretrained``; each mp rank's sharding rank 0 writes its slices
(``full_state_dict``) and their split axes to ``tp_slices_<mp rank>.npz``, from which
single_process_3d.py builds the full weights to compare the ``from_pretrained`` load
with, exactly.

argv: JSON ``{"work": dir}`` (shared by the ranks and single_process_3d.py).
"""

import json
import os

import numpy as np
from common import config_from_argv, finish, init_fleet, max_rel, report_over
import parity

import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.load_state_dict import load_state_dict
from paddle.distributed.flex_checkpoint.dcp.save_state_dict import save_state_dict

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.integrations.paddleformers import export_pretrained
from tp_llama import (batches, full_weights, llama, make_opt, mp_slice, reference, set_slices,
                      train)

STEPS, SAVE_AT, MICRO, ROWS = 4, 2, 2, 4  # ROWS: the global batch's rows per micro-batch
TP = {"mp_degree": 2, "sharding_degree": 2, "outer": 2}
DP = {"sharding_degree": 4, "outer": 2}


def scheduler():
    return paddle.optimizer.lr.ExponentialDecay(learning_rate=0.02, gamma=0.7)


def sharded(hcg, weights):
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    model = llama(mp, mp_rank)
    set_slices(model, weights, mp, mp_rank)
    for layer in model.model.layers:
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    sched = scheduler()
    return model, make_opt(model.parameters(), sched), sched


def run(hcg, model, opt, sched, steps):
    n, d = hcg.get_sharding_parallel_world_size(), hcg.get_sharding_parallel_rank()
    per = ROWS // n
    losses, _ = train(model, opt, steps, rows=slice(d * per, (d + 1) * per),
                      group=hcg.get_sharding_parallel_group(),
                      split_vocab=hcg.get_model_parallel_world_size() > 1, scheduler=sched,
                      norm_of=paddle_hsdp.last_global_norm)
    return losses


def against(hcg, model, losses, ref, label):
    """Every final slice and the losses against the reference (its last len(losses)),
    reported over the mp group (rank 0's log holds both slices' figure)."""
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    full = paddle_hsdp.full_state_dict(model)
    worst = {name: max_rel(full[name].numpy(), mp_slice(p, ref["params"][name], mp, mp_rank))
             for name, p in model.named_parameters()}
    worst["loss"] = max_rel(losses, ref["losses"][-len(losses):])
    return report_over(hcg.get_model_parallel_group(), label, worst)


def same_params(a, b) -> bool:
    x, y = paddle_hsdp.full_state_dict(a), paddle_hsdp.full_state_dict(b)
    return sorted(x) == sorted(y) and all(np.array_equal(x[k].numpy(), y[k].numpy()) for k in x)


work = config_from_argv()["work"]
CK = os.path.join(work, "tp_ckpt")
parity.set_dtype("float64")
weights = full_weights(7)
data = batches(ROWS, STEPS, MICRO)
ref = reference(weights, data, scheduler)
if dist.get_rank() == 0:
    np.savez(os.path.join(work, "tp_reference.npz"), losses=np.array(ref["losses"]),
             **{k.replace(".", "__"): v for k, v in ref["params"].items()})

hcg = init_fleet(TP)
model, opt, sched = sharded(hcg, weights)
losses = run(hcg, model, opt, sched, data[:SAVE_AT])
checkpoint.save_checkpoint(CK, model, opt, extra={"step": SAVE_AT})
losses += run(hcg, model, opt, sched, data[SAVE_AT:])
worst = against(hcg, model, losses, ref, "TP_CKPT uninterrupted mp2 x sharding2 outer2")
meta = checkpoint.read_metadata(CK)
q = meta["tensors"]["model.layers.0.self_attn.q_proj.weight"]
assert q["shape"] == [32, 32] and q["split"] == {"axis": 1, "degree": 2}, q
print(f"TP_CKPT uninterrupted: max rel diff {worst:.2e}; saved with full shapes and splits",
      flush=True)

# (a) the same layout, other weights before the load: bit-identical steps 3-4
resumed, resumed_opt, resumed_sched = sharded(hcg, full_weights(99))
assert checkpoint.load_checkpoint(CK, resumed, resumed_opt) == {"step": SAVE_AT}
assert resumed_sched.last_epoch == SAVE_AT, resumed_sched.last_epoch  # LR state restored
again = run(hcg, resumed, resumed_opt, resumed_sched, data[SAVE_AT:])
assert again == losses[SAVE_AT:], (again, losses[SAVE_AT:])
assert same_params(resumed, model)
print("TP_CKPT resume mp2 x sharding2 outer2: steps 3-4 and final params bit-identical",
      flush=True)

# Paddle's flex_checkpoint: the ShardedWeights place each mp slice in the full tensor
# (the shape and offset Paddle's own mp layers give), so dcp keeps both mp ranks' rows;
# a same-layout round trip (save_replicas: dcp's reshard path needs a GPU) then one more
# step, identical to the original's
sd = model.sharded_state_dict()
q = sd["model.layers.0.self_attn.q_proj.weight"]
assert q.global_shape == (32, 32) and q.global_offset[1] == 16 * hcg.get_model_parallel_rank(), \
    (q.global_shape, q.global_offset)
save_state_dict({**sd, **opt.sharded_state_dict(sd)}, os.path.join(work, "tp_dcp"),
                save_replicas=True)
dist.barrier()  # one rank writes dcp's metadata; the others return before it is complete
dcp_meta = paddle.load(os.path.join(work, "tp_dcp", "0.metadata"))  # dcp's own record
offsets = {index.global_offset for index in dcp_meta.storage_metadata
           if index.tensor_key == "model.layers.0.self_attn.q_proj.weight"}
assert offsets == {(0, 0), (0, 16)}, offsets  # both mp slices, not one twice
fresh, fresh_opt, fresh_sched = sharded(hcg, full_weights(99))
fresh_sd = fresh.sharded_state_dict()
load_state_dict({**fresh_sd, **fresh_opt.sharded_state_dict(fresh_sd)}, os.path.join(work, "tp_dcp"))
fresh_sched.set_state_dict(sched.state_dict())
assert same_params(fresh, model)
step = data[SAVE_AT:SAVE_AT + 1]
assert run(hcg, fresh, fresh_opt, fresh_sched, step) == run(hcg, model, opt, sched, step)
assert same_params(fresh, model)
print("TP_FLEX_CHECKPOINT: mp slices at their full-tensor offsets; dcp round trip and next "
      "step identical", flush=True)

# a model whose full tensors differ is refused, naming the parameter, nothing changed
other = llama(2, hcg.get_model_parallel_rank(), intermediate=48)
paddle_hsdp.fully_shard(other)
before = {k: v.numpy() for k, v in paddle_hsdp.full_state_dict(other).items()}
try:
    checkpoint.load_checkpoint(CK, other, make_opt(other.parameters()))
    raise AssertionError("a checkpoint of other full shapes loaded")
except checkpoint.CheckpointError as e:
    assert "model.layers.0.mlp.gate_proj.weight" in str(e) and "full shape" in str(e), e
after = paddle_hsdp.full_state_dict(other)
assert all(np.array_equal(after[k].numpy(), v) for k, v in before.items())
print("TP_CKPT other full shapes refused on every rank, naming the parameter", flush=True)

# export: float32, 2 steps, then export_pretrained; the slices for the comparison
paddle.set_default_dtype("float32")
parity.set_dtype("float32")
model32, opt32, sched32 = sharded(hcg, {k: v.astype("float32") for k, v in weights.items()})
run(hcg, model32, opt32, sched32, data[:2])
export_pretrained(model32, os.path.join(work, "tp_export"))
full = paddle_hsdp.full_state_dict(model32)
if hcg.get_sharding_parallel_rank() == 0:
    axes = {n: p.split_axis for n, p in model32.named_parameters()
            if getattr(p, "is_distributed", False)}
    np.savez(os.path.join(work, f"tp_slices_{hcg.get_model_parallel_rank()}.npz"),
             axes=json.dumps(axes), **{k.replace(".", "__"): v.numpy() for k, v in full.items()})
print("TP_EXPORT written", flush=True)
paddle.set_default_dtype("float64")
parity.set_dtype("float64")

# (b) mp1 x sharding4 outer 2
hcg = init_fleet(DP)
model, opt, sched = sharded(hcg, full_weights(99))
assert checkpoint.load_checkpoint(CK, model, opt) == {"step": SAVE_AT}
losses = run(hcg, model, opt, sched, data[SAVE_AT:])
worst = against(hcg, model, losses, ref, "TP_CKPT resume mp1 x sharding4 outer2")
print(f"TP_CKPT resume mp1 x sharding4 outer2: max rel diff {worst:.2e}", flush=True)
paddle.set_default_dtype("float32")
finish()
