"""PaddleFormers' Trainer with HSDP inside tensor and pipeline parallelism (issue 34), 4
CPU ranks, float64, in the PaddleFormers launch after worker_trainer.py's 2 x 2 runs.

argv: the work folder worker_trainer.py records into, then the layouts to run,
comma-separated: ``tp`` (``tensor_model_parallel_size=2``, ``fsdp_outer_degree=2``: mp2 x
sharding2, outer 2) and ``pp`` (``LlamaForCausalLMPipe`` with
``pipeline_model_parallel_size=2``: pp2 x sharding2, outer 2, through the Trainer's own
pipeline path). Each layout, as a job of its own (its arguments run PaddleFormers'
fleet.init, with HSDP's data axes):

* ``<layout>_base``: 6 steps of the untied tiny Llama (global batch 8: 2 data-parallel
  ranks x 4, or x 2 micro-batches of 2 through the pipeline), clipping active, saving at
  step 3, then evaluating; recorded (losses, pre-clip norms, eval loss, the full
  parameters joined from every slice and stage) for single_process_trainer.py to compare
  with the one-process Trainer;
* ``<layout>_resume``: from ``<layout>_base/checkpoint-3`` in the same layout (must equal
  the base's steps 4-6 bit for bit);
* ``<layout>_export``: float32, 1 step, then ``save_model`` into ``<layout>_hf``, which
  single_process_trainer.py loads with ``from_pretrained`` (exactly the recorded full
  parameters);
* ``pp_plain`` (pipeline only): PaddleFormers' own Trainer on the same pipeline model
  without HSDP (pp2 x dp2), the same steps: LlamaForCausalLMPipe's loss layer rounds
  otherwise than LlamaForCausalLM's, so this run, not the one-process Trainer, is what
  ``pp_base``'s parameters are held to float64's bound against. Paddle's
  HybridParallelClipGrad skips float64 grads, so its clip is :class:`PipelineClip`.

worker_trainer.py's 1 x 4 layout then resumes both bases' step-3 checkpoints in plain
data parallelism (``resume_dp_<layout>``).
"""

import os
import sys

import numpy as np

import paddle_hsdp  # noqa: F401  (before fleet.init)
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology as fleet_topology
from paddle.distributed.parallel import parallel_helper

import trainer_common as tc
from common import finish
from paddleformers.transformers import LlamaForCausalLM, LlamaForCausalLMPipe
from tp_llama import set_slices
from paddle_hsdp.checkpoint.full_model import full_model
from paddle_hsdp.integrations.paddleformers import (HSDPTrainer, HSDPTrainingArguments,
                                                    cpu_synchronize_is_a_no_op)
from paddleformers.trainer import Trainer, TrainingArguments

work, layouts = sys.argv[1], sys.argv[2].split(",")
rank = dist.get_rank()
DEGREES = {"tp": {"tensor_model_parallel_size": 2}, "pp": {"pipeline_model_parallel_size": 2}}
PER_DEVICE = {"tp": (4, 1), "pp": (2, 2)}  # (per-device batch, accumulation): 8 a step


def DATA(n=tc.SAMPLES, seed=1):
    # no pad token, and a causal mask for the pipeline model (trainer_common.TokenData)
    return tc.TokenData(n, seed, low=1, causal_mask=True)


def as_a_new_job() -> None:
    """Forget the launch's earlier fleet (HCG and parallel context), so these arguments
    run fleet.init as they would in a job of their own (the earlier groups stay)."""
    fleet_topology._HYBRID_PARALLEL_GROUP = None
    parallel_helper.__parallel_ctx__clz__ = None


def arguments(layout: str, run: str, dtype: str = tc.DTYPE, **extra):
    paddle.set_default_dtype(dtype)
    per_device, accumulation = PER_DEVICE[layout]
    extra.setdefault("weight_decay", tc.WEIGHT_DECAY_3D)
    return HSDPTrainingArguments(**tc.common_args(os.path.join(work, run), per_device,
                                                  accumulation, **extra),
                                 fsdp_outer_degree=2, **DEGREES[layout])


def model_for(layout: str, args, dtype: str = tc.DTYPE):
    """The untied tiny Llama for ``layout``, holding the one-process model's weights:
    this rank's mp slices, or (pipeline) the stage's layers under their one-process
    names."""
    weights = {k: v.numpy() for k, v in tc.build_model(dtype=dtype, tied=False)
               .state_dict().items()}
    config = tc.build_config(tied=False)
    if layout == "pp":
        model = LlamaForCausalLMPipe(config)  # takes its degrees from fleet's HCG
        model.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})
        return model
    mp, mp_rank = args.tensor_model_parallel_size, args.tensor_parallel_rank
    config.tensor_model_parallel_size, config.tensor_parallel_rank = mp, mp_rank
    # whole logits (c_concat): PaddleFormers' criterion casts them to float32 and runs
    # the one-process model's cross entropy on them; with vocabulary-split logits its
    # parallel cross entropy rounds otherwise in float32 (pre-clip norms 4.4e-8 apart
    # from the one-process Trainer, measured), below what a float64 check can see
    config.tensor_parallel_output = False
    model = LlamaForCausalLM(config)
    set_slices(model, weights, mp, mp_rank)
    return model


def train(run: str, trainer, resume=None):
    recorder = tc.Recorder(norm_after=lambda: paddle_hsdp.last_global_norm(trainer.optimizer))
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    assert np.allclose(recorder.logged_norms, recorder.norms, rtol=0, atol=1e-8), (
        recorder.logged_norms, recorder.norms)  # the Trainer logs HSDP's norm
    record = {"losses": recorder.losses, "norms": recorder.norms}
    if trainer.eval_dataset is not None:
        record["eval_loss"] = trainer.evaluate()["eval_loss"]
    full = full_model(trainer.model)  # every mp slice and stage joined on rank 0
    if rank == 0:
        np.savez(os.path.join(work, f"{run}_params.npz"), **tc.params_of(full))
        tc.save_record(os.path.join(work, f"{run}.json"), record)
    print(f"TRAINER_RUN {run} {len(recorder.losses)} steps", flush=True)
    return trainer


def check_hcg(layout: str) -> tuple:
    hcg = fleet.get_hybrid_communicate_group()
    got = (hcg.get_model_parallel_world_size(), hcg.get_pipe_parallel_world_size(),
           hcg.get_sharding_parallel_world_size(), hcg.get_fsdp_outer_degree(),
           hcg.get_data_parallel_world_size())
    want = {"tp": (2, 1, 2, 2, 1), "pp": (1, 2, 2, 2, 1)}[layout]
    assert got == want, (layout, got)
    return got


class PipelineClip(paddle.nn.ClipGradByGlobalNorm):
    """``ClipGradByGlobalNorm`` over a plain pipeline's stages, in float64 (the
    reference run's; data-parallel replicas hold equal grads): the norm's squares summed
    over the pipe group; ``last_norm`` keeps the pre-clip norm."""

    def __init__(self, clip_norm, group):
        super().__init__(clip_norm)
        self.group, self.last_norm = group, None

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads):
        squares = sum(float((g.astype("float64") ** 2).sum()) for _, g in params_grads
                      if g is not None)
        total = paddle.to_tensor([squares], dtype="float64")
        dist.all_reduce(total, group=self.group)
        self.last_norm = float(total.sqrt())
        scale = self.clip_norm / max(self.last_norm, self.clip_norm)
        return [(p, None if g is None else g * scale) for p, g in params_grads]


class PlainPipelineTrainer(Trainer):
    def _wrap_distributed_optimizer(self, optimizer):
        # (PaddleFormers 1.2's own reads self.optimizer._inner_opt before self.optimizer
        # is the wrapped one: AttributeError whenever max_grad_norm > 0)
        wrapped = fleet.distributed_optimizer(optimizer)
        hcg = fleet.get_hybrid_communicate_group()
        wrapped._inner_opt._grad_clip = PipelineClip(tc.CLIP, hcg.get_pipe_parallel_group())
        return wrapped


def plain_pipeline_run() -> None:
    as_a_new_job()
    per_device, accumulation = PER_DEVICE["pp"]
    args = TrainingArguments(**tc.common_args(os.path.join(work, "pp_plain"), per_device,
                                              accumulation, weight_decay=tc.WEIGHT_DECAY_3D),
                             pipeline_model_parallel_size=2, sharding="", amp_master_grad=False)
    paddle.set_default_dtype(tc.DTYPE)
    trainer = PlainPipelineTrainer(model=model_for("pp", args), args=args, train_dataset=DATA())
    recorder = tc.Recorder(norm_after=lambda: trainer.optimizer._inner_opt._grad_clip.last_norm)
    trainer.add_callback(recorder)
    with cpu_synchronize_is_a_no_op():
        trainer.train()
    full = full_model(trainer.model)
    if rank == 0:
        np.savez(os.path.join(work, "pp_plain_params.npz"), **tc.params_of(full))
        tc.save_record(os.path.join(work, "pp_plain.json"),
                       {"losses": recorder.losses, "norms": recorder.norms})
    print(f"TRAINER_RUN pp_plain {len(recorder.losses)} steps", flush=True)


for layout in layouts:
    as_a_new_job()
    print(f"TRAINER_3D_LAYOUT {layout}", flush=True)
    args = arguments(layout, f"{layout}_base", save_strategy="steps", save_steps=3)
    print(f"TRAINER_3D_HCG {layout} {check_hcg(layout)}", flush=True)
    train(f"{layout}_base", HSDPTrainer(model=model_for(layout, args), args=args,
                                        train_dataset=DATA(),
                                        eval_dataset=DATA(16, seed=2)))
    args = arguments(layout, f"{layout}_resume")
    train(f"{layout}_resume", HSDPTrainer(model=model_for(layout, args), args=args,
                                          train_dataset=DATA()),
          resume=os.path.join(work, f"{layout}_base", "checkpoint-3"))
    args = arguments(layout, f"{layout}_export", "float32", max_steps=1)
    export = train(f"{layout}_export", HSDPTrainer(model=model_for(layout, args, "float32"),
                                                   args=args, train_dataset=DATA()))
    export.save_model(os.path.join(work, f"{layout}_hf"))
    if layout == "pp":
        plain_pipeline_run()
    print(f"TRAINER_3D_DONE {layout}", flush=True)
paddle.set_default_dtype("float32")
finish()
