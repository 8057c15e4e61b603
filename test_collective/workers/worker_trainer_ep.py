"""PaddleFormers' Trainer with HSDP under expert parallelism (issue 34), 4 CPU ranks,
float64, in the PaddleFormers launch: ``expert_model_parallel_size=2`` with
``fsdp_outer_degree=2`` (dense params sharded 2 x 2; each expert set held by 2 ranks,
sharded 1 x 2), the project's own MoE model (trainer_moe.py: PaddleFormers' MoE models
need ``paddlefleet``, which does not build on CPU).

argv: the work folder. Runs, each recorded for single_process_trainer.py:

* ``ep_base``: 6 steps (global batch 8: 4 ranks x 2, unshuffled), clipping active, a
  checkpoint at step 3, then evaluating; the final parameters are written per expert
  set (``ep_base_params_ep<k>.npz`` from the first rank of set k: the dense params and
  that set's experts under their global names);
* ``ep_resume``: from ``ep_base/checkpoint-3`` in the same layout (bit for bit);
* ``ep_optim``: ``ep_base`` with ``fsdp_outer_sharding="optim"`` (HFSDP: the dense and
  the expert optimizer state each cut across their outer group).
"""

import os
import sys

import numpy as np

import paddle_hsdp
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology as fleet_topology
from paddle.distributed.parallel import parallel_helper

import trainer_common as tc
from common import finish
from trainer_moe import CLIP, EP, MoEData, MoELM
from paddle_hsdp.engine.registry import units_under
from paddle_hsdp.integrations.paddleformers import HSDPTrainer, HSDPTrainingArguments

work = sys.argv[1]
rank, world = dist.get_rank(), dist.get_world_size()
PER_DEVICE = 2


def arguments(run: str, outer_sharding: str = "none", **extra):
    paddle.set_default_dtype(tc.DTYPE)
    return HSDPTrainingArguments(**tc.common_args(os.path.join(work, run), PER_DEVICE,
                                                  dataloader_shuffle=False,
                                                  max_grad_norm=CLIP, **extra),
                                 fsdp_outer_degree=2, expert_model_parallel_size=EP,
                                 fsdp_outer_sharding=outer_sharding)


def run(name: str, resume=None, outer_sharding="none", **extra):
    # as a job of its own: forget the launch's earlier fleet
    fleet_topology._HYBRID_PARALLEL_GROUP = None
    parallel_helper.__parallel_ctx__clz__ = None
    args = arguments(name, outer_sharding, **extra)
    hcg = fleet.get_hybrid_communicate_group()
    ep_rank = hcg.get_expert_parallel_rank()
    assert ep_rank == rank % EP, (rank, ep_rank)  # what MoEData's expert sets assume
    got = (hcg.get_expert_parallel_world_size(), hcg.get_fsdp_inner_group().nranks,
           hcg.get_fsdp_outer_group().nranks, hcg.get_fsdp_inner_group(is_expert=True).nranks,
           hcg.get_fsdp_outer_group(is_expert=True).nranks)
    assert got == (2, 2, 2, 1, 2), got  # ep, dense inner x outer, expert inner x outer
    assert hcg.get_fsdp_outer_group().ranks == hcg.get_fsdp_outer_group(is_expert=True).ranks
    print(f"TRAINER_EP_HCG {got}", flush=True)
    trainer = HSDPTrainer(model=MoELM(ep_rank), args=args,
                          train_dataset=MoEData(tc.SAMPLES, 1, world),
                          eval_dataset=MoEData(16, 2, world)
                          if resume is None else None)
    cut = {(b.is_expert, b.parts) for u in units_under(trainer.model) for b in u.buffers
           if b.trainable}
    assert cut == {(False, 1 if outer_sharding == "none" else 2),
                   (True, 1 if outer_sharding == "none" else 2)}, cut  # HFSDP: both cut
    recorder = tc.Recorder(norm_after=lambda: paddle_hsdp.last_global_norm(trainer.optimizer))
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    assert np.allclose(recorder.logged_norms, recorder.norms, rtol=0, atol=1e-8)
    record = {"losses": recorder.losses, "norms": recorder.norms}
    if resume is None:
        record["eval_loss"] = trainer.evaluate()["eval_loss"]
    full = paddle_hsdp.full_state_dict(trainer.model)  # dense params + this set's experts
    keep = range(ep_rank * 2, ep_rank * 2 + 2)
    named = {}
    for key, value in full.items():
        parts = key.split(".")
        if parts[0] == "experts":  # local child i is global expert keep[i]
            parts[1] = str(keep[int(parts[1])])
        named[".".join(parts)] = value
    if rank < EP:  # the first rank of each expert set
        np.savez(os.path.join(work, f"{name}_params_ep{ep_rank}.npz"), **tc.params_of(named))
    if rank == 0:
        tc.save_record(os.path.join(work, f"{name}.json"), record)
    print(f"TRAINER_RUN {name} {len(recorder.losses)} steps", flush=True)


run("ep_base", save_strategy="steps", save_steps=3)
run("ep_resume", resume=os.path.join(work, "ep_base", "checkpoint-3"))
run("ep_optim", outer_sharding="optim")  # HFSDP: dense and expert optimizer state cut over outer
paddle.set_default_dtype("float32")
print("TRAINER_EP_DONE", flush=True)
finish()
