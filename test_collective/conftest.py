"""The multi-process tier's shared launches, and its session report: every parity
check's margin, and every run_many.py worker's wall time in its launch.

Each parity check in a worker prints its measured difference and its bound
(workers/parity.py); the launcher collects them. At the end of the run this prints the
checks closest to their bounds, and with ``HSDP_PARITY_LOG=FILE`` appends every record
to FILE as JSON lines, so several runs can be compared (a flakiness sweep).
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

from launcher import (HERE, PARITY_RECORDS, ROOT, WORKER_TIMES, launch, run_single,
                      worker_sections)

# The 4-rank HSDP 2 x 2 workers that share one launch (workers/run_many.py); the
# comm worker first, since it shows a misspelt option refused before any group exists.
HSDP_2X2 = {"sharding_degree": 4, "outer": 2}
# 1 x 4 and 4 x 1 train on explicit meshes there (no fleet.distributed_optimizer variant:
# fleet's optimizer reads fleet's 2 x 2 groups); the fingerprint worker switches the
# check on and off itself; worker_exit ends the launch without a final barrier, leaving
# the clean exit to the atexit handler.
ON_MESH = [[True, False], [False, False], [True, False, True]]
SHARED_2X2_WORKERS = [
    ["worker_comm.py", json.dumps(dict(HSDP_2X2, check_typo=True))],
    ["worker_knobs.py"], ["worker_outer_compress.py"], ["worker_zero.py", json.dumps(HSDP_2X2)],
    ["worker_recipes.py"],
    ["worker_engine.py", json.dumps(HSDP_2X2)],
    ["worker_engine.py", json.dumps(dict(HSDP_2X2, mesh=[0, 1, 2, 3], variants=ON_MESH))],
    ["worker_engine.py", json.dumps(dict(HSDP_2X2, mesh=[[0], [1], [2], [3]],
                                         dim_names=["outer", "inner"], variants=ON_MESH))],
    ["worker_fingerprint.py"], ["worker_one_rank_call.py"], ["worker_master_grad.py"],
    ["worker_user_code.py"], ["worker_optimizer_patterns.py", json.dumps(HSDP_2X2)],
    ["worker_agreement.py", json.dumps(dict(HSDP_2X2, runs=["none", "optim"]))],
    ["worker_full_optim_state.py", json.dumps(HSDP_2X2)], ["worker_outer_degrees.py"]]


@pytest.fixture(scope="session")
def shared_2x2_work():
    """The folder worker_checkpoint.py saves into in the shared launch (test_checkpoint
    resumes from it on 2 ranks and in one process)."""
    return tempfile.mkdtemp(prefix="hsdp_shared_2x2_")


@pytest.fixture(scope="session")
def hsdp_2x2_log(shared_2x2_work):
    """Rank 0's log of one launch running every SHARED_2X2_WORKERS worker in turn (and
    worker_diloco.py, worker_checkpoint.py and worker_hfsdp.py, which save into
    ``shared_2x2_work``, then worker_exit.py, which ends it without a final barrier);
    each test asserts its own worker's lines (a failing worker fails the launch, and so
    every test that uses it, with the ranks' logs)."""
    jobs = SHARED_2X2_WORKERS + [["worker_muon.py", json.dumps(dict(HSDP_2X2,
                                                                    work=shared_2x2_work))],
                                 ["worker_diloco.py", json.dumps({"work": shared_2x2_work})],
                                 ["worker_checkpoint.py", shared_2x2_work],
                                 ["worker_hfsdp.py", json.dumps(dict(
                                     HSDP_2X2, work=shared_2x2_work,
                                     variants=[[1, False], [2, False], [None, True]]))],
                                 ["worker_exit.py", "no_barrier"]]
    return launch(4, "run_many.py", json.dumps(jobs), timeout=900)


# The one 8-rank launch, one fleet.init per layout (common.init_fleet runs fleet.init
# again for a new layout): dp2 x mp2 x sharding2 first, so that it is the launch's first
# fleet.init, as in a job of its own (test_hcg_groups.py: Paddle's own fleet.init failed
# or hung on it before paddle_hsdp's safe gloo sub-groups); then HSDP next to tensor
# parallelism (test_mp_pp.py), Muon next to it, the same layout with ranks built from
# different weights (test_agreement.py), Paddle's pipeline schedule at pp2 x sharding4
# outer 2 (test_3d.py), the MoE parity run, EP 2 (test_moe.py), Muon next to EP
# (worker_muon_3d.py after the worker of its layout; test_muon_owned.py), and 2 x 4:
# worker_engine.py's HSDP variants (with the reduce-scatter twins NCCL gets, forced on
# gloo for this layout's fleet.init only) and worker_hfsdp.py's HFSDP run, whose units
# inherit fsdp_outer_sharding "optim" from fleet's sharding_configs
# (test_engine_parity.py, test_hfsdp.py).
HCG_8 = {"dp_degree": 2, "mp_degree": 2, "sharding_degree": 2, "outer": 2}
MP_8 = {"mp_degree": 2, "sharding_degree": 4, "outer": 2, "tag": "MP"}
# issue 61: the same layout with every rank but each FSDP group's first built from other
# weights (test_agreement.py), in float64
MP_8_APART = dict(MP_8, tag="MP_APART", fleet_opt=[False], seeded_apart=True, dtype="float64")
# train_batch's 1F1B with 4 micro-batches of 2 rows (workers/worker_pipeline.py)
PIPELINE_CONFIGS = {"accumulate_steps": 4, "micro_batch_size": 2}
PIPELINE_8 = {"pp_degree": 2, "sharding_degree": 4, "outer": 2,
              "pipeline_configs": PIPELINE_CONFIGS}
PIPELINE_4 = {"pp_degree": 2, "sharding_degree": 2, "outer": 2,
              "pipeline_configs": PIPELINE_CONFIGS}
MOE_8 = {"sharding_degree": 8, "ep_degree": 2, "moe_sharding_degree": 4, "outer": 2}
HSDP_2X4 = {"sharding_degree": 8, "outer": 2, "outer_sharding": "optim",
            "separate_reduce_scatter": True}
EIGHT_RANK_VARIANTS = [[True, False], [False, True]]
HSDP_2X4_WORKERS = ("worker_engine.py", "worker_hfsdp.py")


@pytest.fixture(scope="session")
def launch_8_log():
    """Rank 0's log of the one 8-rank launch (read it with launcher.worker_sections)."""
    jobs = [["worker_groups.py", json.dumps(HCG_8)],
            ["worker_mp_pp.py", json.dumps(MP_8)],
            ["worker_muon_3d.py", json.dumps(dict(MP_8, part="tp"))],
            ["worker_mp_pp.py", json.dumps(MP_8_APART)],
            ["worker_pipeline.py", json.dumps(PIPELINE_8)],
            ["worker_moe.py", json.dumps(MOE_8)],
            ["worker_muon_3d.py", json.dumps(dict(MOE_8, part="ep"))],
            ["worker_engine.py", json.dumps(dict(HSDP_2X4, variants=EIGHT_RANK_VARIANTS))],
            ["worker_hfsdp.py", json.dumps(dict(HSDP_2X4,
                                                reads_work=tempfile.mkdtemp(prefix="hsdp_2x4_")))]]
    return launch(8, "run_many.py", json.dumps(jobs), timeout=900)


@pytest.fixture(scope="session")
def hsdp_2x4_log(launch_8_log):
    """The 2 x 4 workers' part of the 8-rank launch's log (test_engine_parity.py,
    test_hfsdp.py)."""
    return "\n".join(text for worker, text in worker_sections(launch_8_log)
                     if worker in HSDP_2X4_WORKERS)


# The 2-rank launch: tensor parallelism without sharding (mp2 x sharding1,
# test_degenerate_layouts.py), in that layout the tensor-parallel Llama with the clip
# active at every step of 6 (SGD and AdamW; issue 48's one-replica row; test_3d.py, when
# PaddleFormers is installed), then the 1 x 2 resume of the checkpoint the shared 2 x 2
# launch saved (sharding2, outer 1; test_checkpoint.py), one fleet.init each, and
# Paddle's optimizer patterns at 1 x 2 on the latter (test_optimizer_patterns.py), then
# ranks built from different seeds at 1 x 2 (test_agreement.py), and a full optimizer
# state in and out at 1 x 2 (test_optimizer_state.py).
MP_ONLY = {"mp_degree": 2, "sharding_degree": 1, "outer": 1, "tag": "MP_ONLY",
           "fleet_opt": [False, True]}
TP_LLAMA_2 = {"layouts": [{"mp_degree": 2, "sharding_degree": 1, "outer": 1,
                           "runs": ["clip_sgd", "clip_adamw"]}]}


def has_paddleformers() -> bool:
    return importlib.util.find_spec("paddleformers") is not None


@pytest.fixture(scope="session")
def launch_2_log(hsdp_2x2_log, shared_2x2_work):
    tp_llama = [["worker_tp_llama.py", json.dumps(TP_LLAMA_2)]] if has_paddleformers() else []
    jobs = [["worker_mp_pp.py", json.dumps(MP_ONLY)], *tp_llama,
            ["worker_checkpoint_2ranks.py", shared_2x2_work],
            ["worker_optimizer_patterns.py", json.dumps({"sharding_degree": 2, "outer": 1})],
            ["worker_agreement.py", json.dumps({"sharding_degree": 2, "outer": 1})],
            ["worker_full_optim_state.py", json.dumps({"sharding_degree": 2, "outer": 1})]]
    return launch(2, "run_many.py", json.dumps(jobs), timeout=900)


@pytest.fixture(scope="session")
def crashed_save():
    """The launch of worker_resume_after_fault.py that loses rank 3 in the middle of a
    save (test_faults.py): ``(work dir, exit code, {workerlog.N: text})``. The resume
    from what it left runs in the second 4-rank launch (launch_4_log)."""
    work = tempfile.mkdtemp(prefix="hsdp_resume_fault_")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.join(HERE, "workers"),
               GLOG_minloglevel="2")
    log_dir = os.path.join(work, "crash_logs")
    crash = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "4",
         "--log_dir", log_dir, os.path.join(HERE, "workers", "worker_resume_after_fault.py"),
         work, "crash"], env=env, cwd=work, capture_output=True, text=True, timeout=150)
    logs = {os.path.basename(p): open(p, errors="replace").read()
            for p in glob.glob(os.path.join(log_dir, "workerlog.*"))}
    return work, crash.returncode, logs


# The second 4-rank launch: the workers of layouts other than the shared 2 x 2 (and
# nothing but workers that end with a barrier before the last), one fleet.init per
# layout (common.init_fleet). worker_mesh.py first: it shards on explicit meshes after
# init_parallel_env alone (no fleet HCG may exist yet; test_mesh_parity.py); then
# worker_config.py, whose YAML file initialises fleet (2 x 2, the launch's first
# fleet.init; test_config_driven.py); fleet's dp2 x sharding2 (outer 2) with an explicit
# mesh (test_degenerate_layouts.py); sharding4 x EP 2 x moe_sharding2 (outer 2) for the
# expert checkpoints (test_checkpoint.py); Paddle's pipeline schedule at pp2 x sharding2
# outer 2, saving a checkpoint it resumes there (test_3d.py, test_checkpoint.py); 2 x 2
# for the resume after crashed_save (test_faults.py) and, in that layout, the pipeline's
# checkpoint resumed in one stage (pp1 x sharding4 outer 2; test_checkpoint.py);
# worker_exit.py's check mode last, which stops every store server of the launch and
# exits without a final barrier (test_exit.py).
@pytest.fixture(scope="session")
def moe_work():
    """The folder worker_checkpoint_moe.py saves its EP-2 checkpoint into (the second
    4-rank launch), which single_process_resume.py loads into one process."""
    return tempfile.mkdtemp(prefix="hsdp_moe_ckpt_")


@pytest.fixture(scope="session")
def launch_4_log(crashed_save, moe_work):
    pipeline = dict(PIPELINE_4, work=tempfile.mkdtemp(prefix="hsdp_pipeline_"))
    jobs = [["worker_mesh.py"], ["worker_config.py", tempfile.mkdtemp(prefix="hsdp_config_")],
            ["worker_dp_mesh.py"], ["worker_checkpoint_moe.py", moe_work],
            ["worker_pipeline.py", json.dumps(pipeline)],
            ["worker_resume_after_fault.py", crashed_save[0], "resume"],
            ["worker_pipeline.py", json.dumps(dict(HSDP_2X2, resume=pipeline))],
            ["worker_exit.py", "check"]]
    return launch(4, "run_many.py", json.dumps(jobs), timeout=900)


@pytest.fixture(scope="session")
def single_resume_out(hsdp_2x2_log, shared_2x2_work, launch_2_log, launch_4_log, moe_work):
    """One plain process resuming what the launches saved (single_process_resume.py):
    the 2 x 2 checkpoint, the HFSDP one, the EP-2 one (test_checkpoint.py, test_hfsdp.py)."""
    return run_single("single_process_resume.py", shared_2x2_work, moe_work)


# The 4-rank launch that imports PaddleFormers (about 15 s on 4 CPU ranks), so every
# worker that needs it shares it: PaddleFormers' Trainer with HSDP (2 x 2; then inside
# tensor parallelism mp2 x sharding2 and pipeline parallelism pp2 x sharding2, outer 2;
# then the 1 x 4 resumes of the 2 x 2, TP and PP checkpoints; test_trainer.py), then HSDP inside a tensor-parallel PaddleFormers Llama at
# mp2 x sharding2, outer 1 then 2, with and without sequence parallelism (test_3d.py),
# and the CPU shims against the ops' definitions on the last layout's mp group (no
# fleet.init of its own; test_3d.py); then the tensor-parallel Llama's checkpoints and
# export (the same layout, then mp1 x sharding4 outer 2) and PaddleFormers' pipeline
# Llama's at pp2 x sharding2 outer 2 (test_checkpoint.py, which resumes them in one
# process with single_process_3d.py); last, a LoRA model's adapters and merged export
# over 2 x 2 shards (test_paddleformers_cli.py).
TP_LLAMA = {"layouts": [
    {"mp_degree": 2, "sharding_degree": 2, "outer": 1,
     "runs": ["tpo", "sp_before", "sp_after_fused", "sp_no_hooks", "clip_sgd", "clip_adamw"]},
    {"mp_degree": 2, "sharding_degree": 2, "outer": 2,
     "runs": ["concat", "sp_after", "sp_before_fused", "sp_callback", "clip_sgd",
              "clip_adamw"]}]}


@pytest.fixture(scope="session")
def trainer_work():
    """The folder worker_trainer.py saves its runs into (test_trainer.py)."""
    return tempfile.mkdtemp(prefix="hsdp_trainer_")


@pytest.fixture(scope="session")
def threed_work():
    """The folder the 3D checkpoint workers save into (worker_tp_checkpoint.py,
    worker_llama_pipe.py) and single_process_3d.py reads (test_checkpoint.py)."""
    return tempfile.mkdtemp(prefix="hsdp_3d_")


@pytest.fixture(scope="session")
def paddleformers_4_log(trainer_work, threed_work):
    pytest.importorskip("paddleformers.trainer", reason="PaddleFormers is an optional "
                        "extra: pip install paddle_hsdp[paddleformers] (tools/test.sh "
                        "installs it)")
    jobs = [["worker_trainer.py", trainer_work, "2"],
            ["worker_trainer_3d.py", trainer_work, "tp,pp"],
            ["worker_trainer_ep.py", trainer_work],
            ["worker_trainer.py", trainer_work, "1", "tp,pp"],
            ["worker_tp_llama.py", json.dumps(TP_LLAMA)],
            ["worker_cpu_ops.py", json.dumps(TP_LLAMA["layouts"][-1])],
            ["worker_tp_checkpoint.py", json.dumps({"work": threed_work})],
            ["worker_llama_pipe.py", json.dumps(dict(PIPELINE_4, work=threed_work))],
            ["worker_lora_export.py", json.dumps({"work": threed_work})]]
    return launch(4, "run_many.py", json.dumps(jobs), timeout=900)


# The 6-rank launch (issue 48): the tensor-parallel Llama at an outer degree that is not a
# power of two, mp2 x sharding3: three replicas of one rank (outer 3), then one replica of
# three (outer 1: the vocabulary slice's 32 rows cut 11 / 11 / 10), each with both
# optimizers and the clip active at every step of 6 (test_3d.py).
TP_LLAMA_6 = {"layouts": [
    {"mp_degree": 2, "sharding_degree": 3, "outer": 3, "runs": ["tpo", "clip_sgd", "clip_adamw"]},
    {"mp_degree": 2, "sharding_degree": 3, "outer": 1, "runs": ["clip_sgd", "clip_adamw"]}]}


@pytest.fixture(scope="session")
def paddleformers_6_log():
    pytest.importorskip("paddleformers.trainer", reason="PaddleFormers is an optional "
                        "extra: pip install paddle_hsdp[paddleformers] (tools/test.sh "
                        "installs it)")
    jobs = [["worker_tp_llama.py", json.dumps(TP_LLAMA_6)]]
    return launch(6, "run_many.py", json.dumps(jobs), timeout=600)


# tools/test.sh runs this tier as two pytest processes side by side
# (--collective-stream): "own" takes the files below, whose tests start jobs of their own
# and spend them mostly waiting (heartbeat and collective timeouts, leases, an etcd away
# for 45 s, the CLI's and the tools' launchers), beside "shared", every other test, whose
# launches keep the cores busy. A test that uses one of this file's fixtures stays in
# "shared" wherever it is, so no shared launch runs in both processes.
OWN_JOB_FILES = {"test_fault_tolerance.py", "test_two_hosts.py", "test_paddleformers_cli.py",
                 "test_bench.py", "test_longrun.py", "test_lazy_init.py"}
STREAMS = ("shared", "own")


def pytest_addoption(parser):
    parser.addoption("--collective-stream", choices=STREAMS, default=None,
                     help="run only this part of test_collective/ (tools/test.sh runs both "
                          "side by side; default: every test)")


def _is_shared_fixture(fixturedef) -> bool:
    return getattr(fixturedef.func, "__globals__", None) is globals()


def _stream_of(item) -> str:
    uses_shared = any(_is_shared_fixture(d) for defs in item._fixtureinfo.name2fixturedefs.values()
                      for d in defs)
    own_file = os.path.basename(str(item.fspath)) in OWN_JOB_FILES
    return "own" if own_file and not uses_shared else "shared"


def pytest_collection_modifyitems(config, items):
    stream = config.getoption("--collective-stream")
    if stream is None:
        return
    kept = [item for item in items if _stream_of(item) == stream]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


class _SharedLaunchGuard:
    """In the "own" stream: a shared launch asked for by name (request.getfixturevalue)
    would run a second time beside "shared"; refused, naming the fix. A plugin of its
    own, since pytest asks a session fixture's hooks of the session, not of this folder."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if _is_shared_fixture(fixturedef):
            raise pytest.UsageError(
                f"a test of the 'own' stream asks for conftest.py's {fixturedef.argname} "
                f"by name: name it as an argument, or take its file out of OWN_JOB_FILES")


def pytest_configure(config):
    if config.getoption("--collective-stream") == "own":
        config.pluginmanager.register(_SharedLaunchGuard(), "hsdp_shared_launch_guard")


def pytest_terminal_summary(terminalreporter):
    if WORKER_TIMES:
        terminalreporter.write_line("run_many.py workers' wall time (s): " + ", ".join(
            f"{worker} {seconds:.1f} ({where})" for where, worker, seconds in WORKER_TIMES))
    if not PARITY_RECORDS:
        return
    path = os.environ.get("HSDP_PARITY_LOG")
    if path:
        with open(path, "a") as f:
            for record in PARITY_RECORDS:
                f.write(json.dumps(record) + "\n")

    def margin(r):
        return r["bound"] / r["measured"] if r["measured"] > 0 else float("inf")

    rows = sorted(PARITY_RECORDS, key=margin)
    write = terminalreporter.write_line
    write(f"parity checks: {len(rows)}; the 8 closest to their bounds (margin = bound / measured):")
    for r in rows[:8]:
        write(f"  {margin(r):10.3g}x  {r['measured']:.2e} of {r['bound']:.0e} "
              f"{r['dtype']:8s} {r['name']}  [{r['test']}]")
