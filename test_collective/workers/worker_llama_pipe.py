"""PaddleFormers' pipeline Llama (``LlamaForCausalLMPipe``) with HSDP inside each stage,
at pp2 x sharding2 outer 2 on 4 CPU ranks (issue 33): its checkpoint and its export
under the one-process model's names.

The model (float32, the tiny Llama of tp_llama.py) takes the one-process weights by
name (PaddleFormers' ``set_state_dict`` maps them to the stages), every decoder layer of
a stage is a ``fully_shard`` unit and the stage the root; it trains STEPS steps with
``train_batch`` (1F1B), then saves a checkpoint and exports. Each stage's sharding rank
0 writes that stage's weights as PaddleFormers names them (``state_dict()`` of a
``PipelinePretrainedModel``: the one-process names) to ``pipe_stage_<stage>.npz``;
single_process_3d.py loads the checkpoint into a plain ``LlamaForCausalLM`` and the
export with ``from_pretrained`` and compares both with those, exactly.

argv: JSON: a layout for common.init_fleet (with ``pipeline_configs``) and ``work``.
"""

import os

import numpy as np
from common import config_from_argv, finish, init_fleet

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.integrations.paddleformers import export_pretrained
from paddleformers.transformers import LlamaForCausalLMPipe
from tp_llama import batches, config, full_weights, make_opt

STEPS = 2

layout = config_from_argv()
work = layout["work"]
hcg = init_fleet(layout)
weights = full_weights(7)
model = LlamaForCausalLMPipe(config())
model.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})
decoders = [layer for layer in model.run_function if "DecoderLayer" in type(layer).__name__]
assert decoders, [type(layer).__name__ for layer in model.run_function]
for layer in decoders:
    paddle_hsdp.fully_shard(layer)
paddle_hsdp.fully_shard(model)
pipe = fleet.distributed_model(model)
opt = fleet.distributed_optimizer(make_opt(model.parameters()))
n, d = hcg.get_sharding_parallel_world_size(), hcg.get_sharding_parallel_rank()
rows = layout["pipeline_configs"]["accumulate_steps"] * layout["pipeline_configs"]["micro_batch_size"]
for step in batches(n * rows, STEPS, 1):
    ids = step[0][d * rows:(d + 1) * rows]
    loss = pipe.train_batch([paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:])], opt)
print(f"PIPE_LLAMA stage {hcg.get_stage_id()} trained {STEPS} steps, loss {float(loss):.4f}",
      flush=True)

checkpoint.save_checkpoint(os.path.join(work, "pipe_ckpt"), model)
meta = checkpoint.read_metadata(os.path.join(work, "pipe_ckpt"))
assert "model.layers.1.mlp.up_proj.weight" in meta["tensors"], sorted(meta["tensors"])
assert meta["tensors"]["lm_head.weight"]["stages"] == [1], meta["tensors"]["lm_head.weight"]
export_pretrained(model, os.path.join(work, "pipe_export"))
stage = model.state_dict()  # PaddleFormers' own one-process names; a collective
if d == 0:
    np.savez(os.path.join(work, f"pipe_stage_{hcg.get_stage_id()}.npz"),
             **{k.replace(".", "__"): v.numpy() for k, v in stage.items()})
dist.barrier()
print("PIPE_LLAMA checkpoint and export written under the one-process names", flush=True)
finish()
