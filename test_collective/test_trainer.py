"""PaddleFormers' Trainer with HSDP on real CPU ranks (issue 18): workers/worker_trainer.py
trains on 4 ranks in conftest's PaddleFormers launch (2 x 2: every run; then 1 x 4: a resume in another
layout, after a fleet.init of its own; resuming the
engine's checkpoints in 4 x 1 and the other layouts is test_checkpoint's), then
workers/single_process_trainer.py, a fresh process, trains the one-process references
and checks every run against them (losses, pre-clip norms, eval loss, final parameters),
the resumes, and the exports through ``from_pretrained``."""

import os
import subprocess
import sys

import pytest

from launcher import HERE, ROOT, collect_parity, part_of

pytest.importorskip("paddleformers.trainer", reason="PaddleFormers is an optional extra: "
                    "pip install paddle_hsdp[paddleformers] (tools/test.sh installs it)")


@pytest.fixture(scope="module")
def trainer_logs(paddleformers_4_log, trainer_work):
    # conftest's PaddleFormers launch: the 2 x 2 runs, then the resume in 1 x 4 (its
    # own fleet.init there), then other workers
    work = trainer_work
    log = part_of(paddleformers_4_log, "worker_trainer.py")
    parts = log.split("TRAINER_LAYOUT outer ")[1:]
    logs = {int(part.split(maxsplit=1)[0]): part for part in parts}
    assert sorted(logs) == [1, 2], log[-3000:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, os.path.join(HERE, "workers"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "workers",
                                                        "single_process_trainer.py"), work],
                          env=env, cwd=work, capture_output=True, text=True, timeout=600)
    collect_parity(proc.stdout, "single_process_trainer.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return logs, proc.stdout


def test_bad_arguments_are_refused_before_any_group_exists(trainer_logs):
    logs, _ = trainer_logs
    assert "TRAINER_REFUSED 15 on rank 0" in logs[2], logs[2][-2000:]


def test_arguments_before_or_after_the_model_give_the_hsdp_groups(trainer_logs):
    logs, _ = trainer_logs
    assert "TRAINER_HCG model_first (2, 2)" in logs[2], logs[2][-2000:]
    assert "TRAINER_HCG args_first (2, 2)" in logs[2], logs[2][-2000:]


@pytest.mark.parametrize("run", ["base", "recompute", "ga2_zero3", "ga2_zero1",
                                 "plain_trainer", "muon"])
def test_run_matches_the_one_process_trainer(trainer_logs, run):
    _, checks = trainer_logs
    assert f"TRAINER_MATCHES {run}\n" in checks, checks[-3000:]


def test_resume_from_a_checkpoint_in_any_layout(trainer_logs):
    logs, checks = trainer_logs
    assert "TRAINER_RESUME_BIT_EXACT 2x2" in checks, checks[-3000:]
    assert "TRAINER_WORKER_DONE outer 1" in logs[1], logs[1][-2000:]
    assert "TRAINER_MATCHES resume_1\n" in checks, checks[-3000:]
    assert "TRAINER_MATCHES resume_one_process" in checks, checks[-3000:]


def test_save_model_loads_with_from_pretrained_exactly(trainer_logs):
    _, checks = trainer_logs
    for folder in ("hf", "paddle_layout", "hf_untied"):
        assert f"TRAINER_FROM_PRETRAINED_EXACT {folder}" in checks, checks[-3000:]


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_tensor_and_pipeline_parallel_runs_match_resume_and_export(trainer_logs, layout,
                                                                   paddleformers_4_log):
    """workers/worker_trainer_3d.py (issue 34): HSDPTrainer with tensor parallelism 2 and
    with LlamaForCausalLMPipe at pipeline 2, sharding 2 outer 2 each: per-step loss,
    pre-clip norm, eval loss and final parameters against the one-process Trainer;
    resumed bit for bit in the same layout and within the bounds in plain HSDP 1 x 4;
    save_model loaded with from_pretrained exactly."""
    log = part_of(paddleformers_4_log, "worker_trainer_3d.py")
    hcg = {"tp": "(2, 1, 2, 2, 1)", "pp": "(1, 2, 2, 2, 1)"}[layout]  # mp, pp, sharding, outer, dp
    assert f"TRAINER_3D_HCG {layout} {hcg}" in log, log[-3000:]
    _, checks = trainer_logs
    lines = {"tp": ["TRAINER_MATCHES tp_base\n", "TRAINER_MATCHES resume_dp_tp\n"],
             "pp": ["TRAINER_MATCHES pp_base vs pp_plain\n", "TRAINER_MATCHES pp_base\n",
                    "TRAINER_MATCHES resume_dp_pp vs one process\n"]}[layout]
    for line in lines + [f"TRAINER_RESUME_BIT_EXACT {layout}",
                         f"TRAINER_FROM_PRETRAINED_EXACT {layout}_hf"]:
        assert line in checks, checks[-3000:]


def test_expert_parallel_run_matches_resumes_and_loads_in_one_process(trainer_logs,
                                                                      paddleformers_4_log):
    """workers/worker_trainer_ep.py (issue 34): HSDPTrainer with
    expert_model_parallel_size 2 and fsdp_outer_degree 2 on the project's MoE model
    (PaddleFormers' MoE models need paddlefleet, which does not build on CPU): fleet's
    expert groups under HSDP (dense 2 x 2, experts 1 x 2, one outer group for both);
    per-step loss, pre-clip norm, eval loss and final parameters against the one-process
    Trainer holding every expert, also with fsdp_outer_sharding "optim" (HFSDP); resumed
    bit for bit in the same layout and within the bounds in one process."""
    log = part_of(paddleformers_4_log, "worker_trainer_ep.py")
    assert "TRAINER_EP_HCG (2, 2, 2, 1, 2)" in log and "TRAINER_EP_DONE" in log, log[-3000:]
    _, checks = trainer_logs
    for line in ("TRAINER_MATCHES ep_base\n", "TRAINER_MATCHES ep_optim\n",
                 "TRAINER_RESUME_BIT_EXACT ep",
                 "TRAINER_MATCHES resume_ep_one_process\n"):
        assert line in checks, checks[-3000:]
