"""PaddleFormers' Trainer on HSDP, 4 CPU ranks (issue 18). argv: a work folder, and
``fsdp_outer_degree`` values, comma-separated, run in turn in this one launch (2: the
full set of runs; 1 or 4: resume only; "2,1": both, the resume in 1 x 4 after the 2 x 2
runs). Each layout's part of the log starts with ``TRAINER_LAYOUT outer N``.

With outer 2, in one launch:
1. every refusal of ``HSDPTrainingArguments`` raises ``ConfigError`` naming the
   argument, on every rank, while no fleet group exists (nothing collective ran);
2. the model built first, then the arguments (their ``__post_init__`` runs fleet.init
   with HSDP): the HCG is outer 2 x inner 2; later runs build the arguments first
   (fleet live: checked, not re-initialised) and get the same groups;
3. ``HSDPTrainer`` runs, each recorded for single_process_trainer.py to compare with
   the one-process Trainer: ``base`` (ZeRO-3; saves checkpoints at steps 3 and 6,
   evaluates), ``export`` and ``export_untied`` (float32, 2 steps, then ``save_model``,
   with and without ``last_fc_to_hf``; ``save_pretrained`` on the sharded model is
   refused), ``recompute``,
   ``ga2_zero3`` and ``ga2_zero1`` (2 accumulation steps), ``resume`` (from base's
   step 3, must equal base's steps 4-6 bit for bit), ``muon`` (``optim: muon``:
   paddle_hsdp.Muon over owned matrices);
4. ``plain_trainer``: PaddleFormers' own ``Trainer(sharding="")`` over a model sharded
   by ``apply_config`` with full recompute: the Trainer's fused all-reduce of every
   parameter's grad must leave the shards alone (the guard in paddle_hsdp.patches).

With outer 1 or 4: resume base's step-3 checkpoint in that layout (``resume_1`` /
``resume_4``), and with a third argument (``tp,pp``) also worker_trainer_3d.py's
tensor- and pipeline-parallel checkpoints of step 3, in plain HSDP
(``resume_dp_<layout>``, the untied model). After another layout in the same launch,
the fleet HCG is forgotten first, so the resume's arguments run fleet.init with their
own layout, as in a launch of their own (their __post_init__ would otherwise check the
live topology and refuse).
"""

import os
import sys

import numpy as np

import paddle_hsdp  # noqa: F401  (before fleet.init)
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology as fleet_topology

from paddleformers.trainer import Trainer, TrainingArguments

import trainer_common as tc
from common import finish
from paddle_hsdp import ConfigError
from paddle_hsdp.integrations.paddleformers import HSDPTrainer, HSDPTrainingArguments

work, outers = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
# worker_trainer_3d.py's layouts whose step-3 checkpoints the resume layouts also resume
resume_3d = sys.argv[3].split(",") if len(sys.argv) > 3 else []
rank = dist.get_rank()


def hsdp_args(run: str, per_device=2, accumulation=1, **extra):
    return HSDPTrainingArguments(**tc.common_args(os.path.join(work, run), per_device,
                                                  accumulation, **extra),
                                 fsdp_outer_degree=outer)


def train(run: str, trainer, resume=None):
    recorder = tc.Recorder(norm_after=lambda: paddle_hsdp.last_global_norm(trainer.optimizer))
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    record = {"losses": recorder.losses, "norms": recorder.norms}
    if isinstance(trainer, HSDPTrainer):  # it logs HSDP's pre-clip norm as global_norm
        assert np.allclose(recorder.logged_norms, recorder.norms, rtol=0, atol=1e-8), (
            recorder.logged_norms, recorder.norms)
    if trainer.eval_dataset is not None:
        record["eval_loss"] = trainer.evaluate()["eval_loss"]
    full = tc.params_of(paddle_hsdp.full_state_dict(trainer.model))
    if rank == 0:
        np.savez(os.path.join(work, f"{run}_params.npz"), **full)
        tc.save_record(os.path.join(work, f"{run}.json"), record)
    print(f"TRAINER_RUN {run} {len(recorder.losses)} steps", flush=True)
    return trainer


def check_hcg():
    hcg = fleet.get_hybrid_communicate_group()
    got = (hcg.get_fsdp_outer_group().nranks, hcg.get_fsdp_inner_group().nranks)
    assert got == (outer, 4 // outer), got
    return got


def full_runs():
    """Outer 2: parts 1-4 of the module docstring."""
    # 1. refusals, before any group exists
    REFUSALS = [({"sharding": "stage4"}, "sharding: 'stage4'; allowed"),
                ({"tensor_model_parallel_size": 3}, "tensor_model_parallel_size: 3"),
                ({"sep_parallel_size": 2}, "sep_parallel_size:"),
                ({"fsdp_outer_sharding": "all"}, "fsdp_outer_sharding:"),
                ({"fp16": True}, "fp16:"),
                ({"fsdp_outer_degree": "two"}, "fsdp_outer_degree:"),
                ({"fsdp_outer_degree": 3}, "fsdp_outer_degree: 3 does not divide"),
                ({"save_checkpoint_format": "unified_checkpoint"}, "save_checkpoint_format:"),
                ({"hsdp_checkpoint": False, "save_checkpoint_format": None},
                 "save_checkpoint_format: None saves or loads on rank 0 only"),
                ({"hsdp_config": {"fsdp_outer_degree": 4}}, "disagrees with hsdp_config"),
                ({"hsdp_config": {"sharding_sise": 2}}, "sharding_size"),
                ({"expert_model_parallel_size": 3}, "expert_model_parallel_size: 3 does not "
                 "divide the 4 ranks"),
                ({"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2},
                 "expert_model_parallel_size: 2 together with tensor or pipeline"),
                ({"expert_model_parallel_size": 2, "fsdp_outer_degree": 4},
                 "fsdp_outer_degree: 4 does not divide the 2 expert data-parallel ranks"),
                ({"expert_model_parallel_size": 2, "use_expert_parallel": True},
                 "use_expert_parallel: True switches on")]
    for bad, fragment in REFUSALS:
        kwargs = dict(tc.common_args(os.path.join(work, "refused"), 2), fsdp_outer_degree=2)
        kwargs.update(bad)
        try:
            HSDPTrainingArguments(**kwargs)
        except ConfigError as e:
            assert fragment in str(e), (bad, str(e))
        else:
            raise AssertionError(f"accepted: {bad}")
        assert fleet_topology._HYBRID_PARALLEL_GROUP is None, bad
    print(f"TRAINER_REFUSED {len(REFUSALS)} on rank {rank}", flush=True)

    # 2. the model first, then the arguments: they run fleet.init with HSDP
    model = tc.build_model()
    args = hsdp_args("base", save_strategy="steps", save_steps=3)
    print("TRAINER_HCG model_first", check_hcg(), flush=True)
    base = HSDPTrainer(model=model, args=args, train_dataset=tc.TokenData(),
                       eval_dataset=tc.TokenData(16, seed=2))
    train("base", base)

    # exports, in float32 (PaddleFormers' loader has no float64): 2 steps, then both
    # save_model forms, and the full state dict they must load as
    export = HSDPTrainer(model=tc.build_model(dtype="float32"),
                         args=hsdp_args("export", max_steps=2), train_dataset=tc.TokenData())
    train("export", export)
    export.save_model(os.path.join(work, "hf"), last_fc_to_hf=True)
    export.save_model(os.path.join(work, "paddle_layout"))
    untied = HSDPTrainer(model=tc.build_model(dtype="float32", tied=False),
                         args=hsdp_args("export_untied", max_steps=2),
                         train_dataset=tc.TokenData())
    train("export_untied", untied)
    untied.save_model(os.path.join(work, "hf_untied"))
    # save_pretrained on the sharded model itself: refused on each rank that calls it
    # (here every rank, then rank 0 alone), before any collective, naming the way
    for callers in ([0, 1, 2, 3], [0]):
        if rank in callers:
            try:
                export.model.save_pretrained(os.path.join(work, "refused"))
            except NotImplementedError as e:
                assert "export_pretrained(model, dir) on every rank" in str(e), e
            else:
                raise AssertionError("save_pretrained on a sharded model was accepted")
        dist.barrier()
    assert not os.path.exists(os.path.join(work, "refused", "model.safetensors"))
    print("TRAINER_EXPORTED", flush=True)

    # 3. the arguments first (fleet is live now: checked against it), then the model
    args = hsdp_args("recompute", recompute_granularity="full")
    print("TRAINER_HCG args_first", check_hcg(), flush=True)
    train("recompute", HSDPTrainer(model=tc.build_model(recompute=True), args=args,
                                   train_dataset=tc.TokenData()))
    train("ga2_zero3", HSDPTrainer(model=tc.build_model(), args=hsdp_args("ga2_zero3", 1, 2),
                                   train_dataset=tc.TokenData()))
    train("ga2_zero1", HSDPTrainer(model=tc.build_model(),
                                   args=hsdp_args("ga2_zero1", 1, 2, hsdp_config={"zero_stage": 1}),
                                   train_dataset=tc.TokenData()))
    train("muon", HSDPTrainer(model=tc.build_model(), args=hsdp_args("muon", **tc.MUON_ARGS),
                              train_dataset=tc.TokenData()))
    train("resume", HSDPTrainer(model=tc.build_model(), args=hsdp_args("resume"),
                                train_dataset=tc.TokenData()),
          resume=os.path.join(work, "base", "checkpoint-3"))

    # 4. PaddleFormers' own Trainer over a sharded model, recompute on
    model, _ = paddle_hsdp.apply_config(tc.build_model(recompute=True), {
        "fsdp_outer_degree": 2, "sub_modules_to_wrap": ["model.layers.{*}"]})
    args = TrainingArguments(**tc.common_args(os.path.join(work, "plain"), 2),
                             sharding="", amp_master_grad=False, recompute_granularity="full")
    plain = Trainer(model=model, args=args, train_dataset=tc.TokenData())
    train("plain_trainer", plain)


def resume_in_another_layout():
    args = hsdp_args(f"resume_{outer}")
    check_hcg()
    train(f"resume_{outer}", HSDPTrainer(model=tc.build_model(), args=args,
                                         train_dataset=tc.TokenData()),
          resume=os.path.join(work, "base", "checkpoint-3"))
    for layout in resume_3d:  # tensor / pipeline parallel checkpoints, in plain HSDP
        run = f"resume_dp_{layout}"
        train(run, HSDPTrainer(model=tc.build_model(tied=False),
                               args=hsdp_args(run, weight_decay=tc.WEIGHT_DECAY_3D),
                               train_dataset=tc.TokenData(low=1, causal_mask=True)),
              resume=os.path.join(work, f"{layout}_base", "checkpoint-3"))


for index, outer in enumerate(outers):
    if fleet_topology._HYBRID_PARALLEL_GROUP is not None:
        # another layout ran in this launch: the arguments below run fleet.init with this one
        fleet_topology._HYBRID_PARALLEL_GROUP = None
    print(f"TRAINER_LAYOUT outer {outer}", flush=True)
    if outer == 2:
        full_runs()
    else:
        resume_in_another_layout()
    print(f"TRAINER_WORKER_DONE outer {outer}", flush=True)
finish()
