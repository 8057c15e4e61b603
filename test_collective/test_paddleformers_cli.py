"""``paddleformers-cli train config.yaml`` with HSDP (issue 67), on 2 and 4 CPU ranks,
against PaddleFormers' own data-parallel run of the same YAML.

The launches (each its own: the CLI starts its ranks itself): PaddleFormers' own run,
full fine-tuning and LoRA (stage SFT) at each world size, and DPO (full fine-tuning) at
2 ranks (workers/cli_reference_plugin.py: the two CPU shims it needs there); HSDP 1 x 2
and 2 x 2 through both ways in, the CLI itself with ``custom_register_path``
(paddle_hsdp/integrations/cli_plugin.py) and ``python -m paddle_hsdp.train``, with the
same YAML plus ``fsdp_outer_degree`` (the 2 x 2 LoRA run also with PaddleFormers'
``sharding: stage1``, mapped to HSDP's ZeRO-1; the DPO run at 1 x 2, its reference
model sharded too); the 1 x 2 runs save checkpoints at step 3, and the CLI resumes the
LoRA run from its copy on its own. Then workers/single_process_cli.py compares, in one
process: every step's loss and the final weights (float32 bound), the DPO reference
model's bytes on a rank, the LoRA checkpoint's content and size, the resume bit for
bit. Every run must end with rc 0: a save that hangs (the LoRA save on rank 0 alone,
before) fails its launch's timeout.

Stage PT has no launch of its own (its 2 x 2 pair became SFT full, which the issue's
done-when lists): PaddleFormers runs PT through the same ``run_sft`` workflow as SFT,
so through the same HSDPSFTTrainer; only its data preparation, PaddleFormers' own,
differs."""


import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from launcher import HERE, ROOT, WORKER_TIMES, collect_parity, part_of

pytest.importorskip("paddleformers.cli", reason="PaddleFormers is an optional extra: "
                    "pip install paddle_hsdp[paddleformers] (tools/test.sh installs it)")

import cli_common  # noqa: E402  (workers/, on pytest.ini's path)

WORKERS = os.path.join(HERE, "workers")

PLUGIN = os.path.join(ROOT, "paddle_hsdp", "integrations", "cli_plugin.py")
REFERENCE_PLUGIN = os.path.join(WORKERS, "cli_reference_plugin.py")
CLI = os.path.join(os.path.dirname(sys.executable), "paddleformers-cli")
CHECKPOINTS = {"save_strategy": "steps", "save_steps": 3}
# name: (ranks, entry, fine_tuning, keys added to PaddleFormers' own YAML)
RUNS = {
    "ref_full_2": (2, "cli", "full", {}),
    "ref_lora_2": (2, "cli", "LoRA", {"custom_register_path": REFERENCE_PLUGIN}),
    "ref_dpo_2": (2, "cli", "full", {"stage": "DPO", "custom_register_path": REFERENCE_PLUGIN}),
    "cli_full_2": (2, "cli", "full", {"custom_register_path": PLUGIN,
                                      "fsdp_outer_degree": 1, **CHECKPOINTS}),
    "train_lora_2": (2, "train", "LoRA", {"fsdp_outer_degree": 1, **CHECKPOINTS}),
    "resume_lora_2": (2, "train", "LoRA", {"fsdp_outer_degree": 1, **CHECKPOINTS,
                                           "overwrite_output_dir": False}),
    "cli_dpo_2": (2, "cli", "full", {"stage": "DPO", "custom_register_path": PLUGIN,
                                     "fsdp_outer_degree": 1}),
    "ref_full_4": (4, "cli", "full", {}),
    "ref_lora_4": (4, "cli", "LoRA", {"custom_register_path": REFERENCE_PLUGIN}),
    "train_full_4": (4, "train", "full", {"fsdp_outer_degree": 2}),
    "cli_lora_4": (4, "cli", "LoRA", {"custom_register_path": PLUGIN, "fsdp_outer_degree": 2,
                                      "sharding": "stage1"}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(work: str, name: str) -> dict:
    ranks, entry, fine_tuning, added = RUNS[name]
    out, logs = os.path.join(work, name), os.path.join(work, f"{name}_logs")
    values = dict(cli_common.base_yaml(work, out, fine_tuning,
                                       stage=added.get("stage", "SFT")), **added)
    path = cli_common.write_yaml(os.path.join(work, f"{name}.yaml"), values)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_minloglevel="2", PADDLE_DISTRI_BACKEND="gloo")
    if entry == "cli":  # the CLI launches one rank per listed device
        env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, range(ranks))),
                   PADDLEFORMERS_DIST_LOG=logs, MASTER_PORT=str(_free_port()))
        cmd = [CLI, "train", path]
    else:
        cmd = [sys.executable, "-m", "paddle_hsdp.train", "--nproc_per_node", str(ranks),
               "--log_dir", logs, path]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=work, timeout=240, capture_output=True,
                              text=True)
        rc, out_text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, out_text = "timeout", ""
    seconds = time.perf_counter() - start
    log = os.path.join(logs, "workerlog.0")
    if rc != 0:
        tails = ""
        for rank in range(ranks):
            p = os.path.join(logs, f"workerlog.{rank}")
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    tails += f"--- {p} ---\n" + "".join(f.readlines()[-30:])
        raise AssertionError(f"{name}: {' '.join(cmd)} failed (rc={rc})\n"
                             f"{out_text[-2000:]}\n{tails}")
    WORKER_TIMES.append((f"{ranks} ranks", f"{name} ({entry})", seconds))
    return {"output_dir": out, "log": log, "seconds": round(seconds, 1)}


@pytest.fixture(scope="module")
def cli_checks():
    work = tempfile.mkdtemp(prefix="hsdp_cli_")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, WORKERS]))
    subprocess.run([sys.executable, os.path.join(WORKERS, "cli_common.py"), work],
                   env=env, check=True, capture_output=True, timeout=300)
    runs = {}
    for name in RUNS:
        if name == "resume_lora_2":  # the CLI finds the checkpoint in its output_dir
            os.makedirs(os.path.join(work, name))
            shutil.copytree(os.path.join(runs["train_lora_2"]["output_dir"], "checkpoint-3"),
                            os.path.join(work, name, "checkpoint-3"))
        runs[name] = _launch(work, name)
    with open(os.path.join(work, "runs.json"), "w") as f:
        json.dump(runs, f)
    proc = subprocess.run([sys.executable, os.path.join(WORKERS, "single_process_cli.py"),
                           work], env=env, cwd=work, capture_output=True, text=True,
                          timeout=300)
    collect_parity(proc.stdout, "single_process_cli.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return runs, proc.stdout


@pytest.mark.parametrize("run,ref", [("cli_full_2", "ref_full_2"),
                                     ("train_lora_2", "ref_lora_2"),
                                     ("cli_dpo_2", "ref_dpo_2"),
                                     ("train_full_4", "ref_full_4"),
                                     ("cli_lora_4", "ref_lora_4")])
def test_hsdp_through_the_cli_matches_paddleformers_own_run(cli_checks, run, ref):
    """Each step's loss and the final weights (full model, or the LoRA adapters) within
    the float32 bound of PaddleFormers' own data-parallel run of the same YAML."""
    _, checks = cli_checks
    assert f"CLI_MATCHES {run} vs {ref}\n" in checks, checks[-3000:]


def test_the_hsdp_runs_sharded_the_model(cli_checks):
    runs, _ = cli_checks
    layouts = {"cli_full_2": "outer 1 x inner 2", "train_lora_2": "outer 1 x inner 2",
               "cli_dpo_2": "outer 1 x inner 2", "train_full_4": "outer 2 x inner 2",
               "cli_lora_4": "outer 2 x inner 2"}
    for run, layout in layouts.items():
        with open(runs[run]["log"], errors="replace") as f:
            log = f.read()
        assert "apply_config(<dict>): " in log and layout in log, (run, log[-2000:])
    with open(runs["cli_lora_4"]["log"], errors="replace") as f:
        assert "zero_stage=1" in f.read()  # PaddleFormers' sharding: stage1


def test_dpo_reference_model_is_sharded_like_the_policy(cli_checks):
    """Each rank of the 1 x 2 DPO run holds half the reference model's weights."""
    _, checks = cli_checks
    assert "CLI_DPO_REFERENCE_SHARDED" in checks, checks[-3000:]


def test_lora_checkpoint_holds_the_adapters_alone(cli_checks):
    _, checks = cli_checks
    assert "CLI_LORA_CHECKPOINT_ADAPTERS_ONLY" in checks, checks[-3000:]


def test_the_cli_resumes_the_lora_checkpoint_bit_for_bit(cli_checks):
    _, checks = cli_checks
    assert "CLI_RESUME_BIT_EXACT" in checks, checks[-3000:]


def test_lora_adapters_and_merged_export_over_2x2_shards(paddleformers_4_log):
    """workers/worker_lora_export.py in conftest's PaddleFormers launch: every rank joins
    the gathers; the adapters load with ``LoRAModel.from_pretrained`` and give the
    unsharded model's logits exactly, the merged export with ``from_pretrained``
    within the float32 bound."""
    log = part_of(paddleformers_4_log, "worker_lora_export.py")
    assert "LORA_EXPORT_OK" in log, log[-3000:]
