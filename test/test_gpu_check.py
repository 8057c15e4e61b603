"""tools/gpu_check.py, the first GPU run's script, as far as a CPU can hold it: the
command line (--help, the one-line refusal without GPUs, the wrapper's flags), and the
pieces that judge a GPU run, fed with made-up inputs: the overlapped fraction of NCCL
kernel time from profiler nodes and from a chrome trace, where the optimizer's tensors
live, the mismatch outcomes with the watchdog's lines, the merged report and its table.
The GPU checks themselves run only where 2+ GPUs are (tools/gpu_check.sh; docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402  (tools/, on pytest.ini's pythonpath)

CUDA = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def _run(*cmd):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


# ------------------------------------------------------------------ command lines
def test_help_lists_the_flags():
    proc = _run(sys.executable, "tools/gpu_check.py", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--only", "--steps", "--out", "--layout", "--report", "--cpu-rehearsal"):
        assert flag in proc.stdout, flag
    assert "mismatch_hang" in proc.stdout


@pytest.mark.skipif(CUDA, reason="a CUDA build with a GPU: the script would not refuse")
def test_without_gpus_it_stops_at_once_with_one_line_and_status_2():
    proc = _run(sys.executable, "tools/gpu_check.py", "--steps", "2")
    assert proc.returncode == gpu_check.EXIT_NO_GPU, proc.stderr[-2000:]
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_check: needs 2+ GPUs with a CUDA build of Paddle; found "), \
        lines[0]
    assert paddle.__version__ in lines[0]


@pytest.mark.skipif(CUDA, reason="a CUDA build with a GPU: preflight would pass")
def test_preflight_refuses_in_process(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--preflight"])
    assert e.value.code == gpu_check.EXIT_NO_GPU
    assert "needs 2+ GPUs" in capsys.readouterr().err
    assert gpu_check.main(["--preflight", "--cpu-rehearsal"]) == 0  # flags only: "2"
    assert capsys.readouterr().out.strip() == "2"


def test_bad_flags_are_refused_before_anything_runs():
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--only", "layout,bogus"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--steps", "0"])
    args = gpu_check.parse_args(["--only", "mismatch, layout"])
    assert args.only == ["layout", "mismatch"]  # CHECKS order, whatever the order given
    assert gpu_check.parse_args([]).only == list(gpu_check.DEFAULT_CHECKS)
    assert "mismatch_hang" not in gpu_check.DEFAULT_CHECKS


def test_wrapper_help_and_the_flags_it_keeps_for_itself():
    proc = _run("bash", "tools/gpu_check.sh", "--help")
    assert proc.returncode == 0 and "--devices" in proc.stdout and "--only" in proc.stdout
    proc = _run("bash", "tools/gpu_check.sh", "--only", "layout")
    assert proc.returncode == 2 and "set by this script" in proc.stderr
    assert "launch" not in proc.stdout


def test_layouts():
    assert gpu_check.parse_layout("1x2", 2) == (1, 2)
    assert gpu_check.parse_layout(" 2X4 ", 8) == (2, 4)
    for bad in ("2x2", "x2", "0x2", ""):
        with pytest.raises(ValueError, match="layout"):
            gpu_check.parse_layout(bad, 2)
    assert gpu_check.other_layout((1, 2), 2) == (2, 1)
    assert gpu_check.other_layout((1, 8), 8) == (2, 4)
    assert gpu_check.other_layout((1, 3), 3) == (3, 1)
    assert gpu_check.other_layout((2, 1), 2) == (1, 2)


def test_gpu_problem_names_what_is_missing():
    problem = gpu_check.gpu_problem
    assert "CPU-only build of Paddle 3.3.1" in problem(False, 0, 1, "3.3.1")
    assert problem(True, 1, 1).endswith("found 1 GPU")
    assert problem(True, 2, 1) is None  # preflight: two GPUs, not launched yet
    assert "paddle.distributed.launch --devices 0,1" in problem(True, 2, 1, launched=True)
    assert problem(True, 1, 2, launched=True) is None  # a launcher may show one GPU a rank
    assert "sees no GPU" in problem(True, 0, 2, launched=True)
    for msg in (problem(False, 0, 1), problem(True, 0, 1), problem(True, 0, 2, launched=True)):
        assert msg.startswith("gpu_check: needs 2+ GPUs with a CUDA build of Paddle")


# ------------------------------------------------------------------ overlap of kernels
RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AG = "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)"
GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32"


def test_kernel_kinds():
    kind = gpu_check.kernel_kind
    assert kind(RS) == "reduce_scatter" and kind(AG) == "all_gather"
    assert kind("ncclDevKernel_AllReduce_Sum_f32_TREE_LL") == "all_reduce"
    assert kind("ncclDevKernel_Generic_4") == "nccl"
    assert kind(GEMM) == "compute" and kind("void phi::funcs::VectorizedKernel<float>") == "compute"


def test_interval_arithmetic():
    assert gpu_check.union([(5, 7), (0, 2), (1, 3), (9, 9)]) == [[0, 3], [5, 7]]
    assert gpu_check.length([(0, 2), (1, 3), (5, 6)]) == 4
    assert gpu_check.intersection_length([(0, 10)], [(2, 3), (8, 12), (20, 30)]) == 3


def test_overlap_report_fraction_of_comm_under_compute():
    kernels = [(GEMM, 0, 10, 7), (GEMM, 20, 30, 7),
               (RS, 5, 15, 13),                     # half under compute
               (AG, 25, 26, 12), (AG, 40, 41, 12)]  # one of two microseconds
    rep = gpu_check.overlap_report(kernels)
    assert rep["compute_kernels"] == 2 and rep["compute_time"] == 20
    assert rep["reduce_scatter"]["overlapped"] == pytest.approx(0.5)
    assert rep["all_gather"]["overlapped"] == pytest.approx(0.5)
    assert rep["all_gather"]["count"] == 2 and rep["all_gather"]["streams"] == ["12"]
    assert rep["nccl_all"]["time"] == 12 and rep["nccl_all"]["overlapped"] == pytest.approx(6 / 12)
    row = gpu_check.profile_row("p", rep, "profiler result", "t.json")
    assert row["status"] == "PASS", row
    assert "reduce_scatter 50% of 0.01 ms under compute" in row["figures"]
    assert "streams 13" in row["figures"]


def test_profile_row_fails_without_overlap_and_skips_without_kernels():
    serial = gpu_check.overlap_report([(GEMM, 0, 10, 7), (RS, 10, 20, 13), (AG, 20, 30, 12)])
    assert gpu_check.profile_row("p", serial, "x", None)["status"] == "FAIL"
    only_compute = gpu_check.overlap_report([(GEMM, 0, 10, 7)])
    row = gpu_check.profile_row("p", only_compute, "x", None)
    assert row["status"] == "FAIL" and "no NCCL kernel" in row["figures"]
    assert gpu_check.profile_row("p", gpu_check.overlap_report([]), "x", None)["status"] == "SKIP"
    generic = gpu_check.overlap_report([(GEMM, 0, 10, 7), ("ncclDevKernel_Generic", 2, 4, 9)])
    assert gpu_check.profile_row("p", generic, "x", None)["status"] == "PASS"  # all NCCL judged


def _device(name, start_ns, end_ns, stream, kind="Kernel"):
    return SimpleNamespace(name=name, start_ns=start_ns, end_ns=end_ns, stream_id=stream,
                           type=SimpleNamespace(name=kind))


def test_kernels_from_profiler_nodes():
    gemm, rs = _device(GEMM, 1000, 9000, 7), _device(RS, 4000, 12000, 13)
    runtime = SimpleNamespace(device_node=[gemm, _device("memcpy", 0, 5, 7, kind="Memcpy")])
    child = SimpleNamespace(children_node=[], runtime_node=[SimpleNamespace(device_node=[rs])],
                            device_node=[gemm])  # the same kernel seen twice counts once
    root = SimpleNamespace(children_node=[child], runtime_node=[runtime], device_node=[])
    kernels = gpu_check.kernels_from_nodes({123: root})
    assert sorted(kernels) == sorted([(GEMM, 1.0, 9.0, 7), (RS, 4.0, 12.0, 13)])  # ns -> us
    assert gpu_check.overlap_report(kernels)["reduce_scatter"]["overlapped"] == pytest.approx(5 / 8)


def test_kernels_from_a_chrome_trace(tmp_path):
    events = [
        {"name": "ProfileStep#1[1.000 ms]", "ph": "X", "cat": "ProfileStep", "ts": 0, "dur": 1000},
        {"name": f"{GEMM}[8.000 us]", "pid": 0, "tid": "7(Stream)", "ts": 10, "dur": 8.0,
         "ph": "X", "cat": "Kernel", "args": {"stream": 7}},
        {"name": f"{RS}[8.000 us]", "pid": 0, "tid": "13(Stream)", "ts": 14, "dur": 8.0,
         "ph": "X", "cat": "Kernel", "args": {"stream": 13}},
        {"name": "Memcpy HtoD", "ph": "X", "cat": "Memcpy", "ts": 0, "dur": 3}, {}]
    path = tmp_path / "rank0.paddle_trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ms", "traceEvents": events}))
    kernels = gpu_check.kernels_from_chrome_trace(str(path))
    assert kernels == [(GEMM, 10.0, 18.0, 7), (RS, 14.0, 22.0, 13)]


# ------------------------------------------------------------------ where tensors live
class _Place:
    def __init__(self, kind):
        self.kind = kind

    def is_cuda_pinned_place(self):
        return self.kind == "pinned"

    def is_gpu_place(self):
        return self.kind == "gpu"

    def is_cpu_place(self):
        return self.kind == "cpu"


def _fake(name, kind, grad_kind=None, stop_gradient=False):
    grad = SimpleNamespace(place=_Place(grad_kind)) if grad_kind else None
    return SimpleNamespace(name=name, place=_Place(kind), grad=grad, stop_gradient=stop_gradient)


def test_storage_report_on_real_cpu_tensors():
    layer = paddle.nn.Linear(3, 2)
    opt = paddle.optimizer.AdamW(parameters=layer.parameters())
    layer(paddle.ones([1, 3])).sum().backward()
    opt.step()
    rep = gpu_check.storage_report(opt)
    assert rep["params"] == 2 and rep["grads"] == 2 and rep["accumulators"] >= 4, rep
    assert rep["bad"] == [] and rep["no_grad"] == 0
    assert gpu_check.place_kind(layer.weight) == "cpu"


def test_storage_report_names_what_is_not_in_plain_host_memory():
    opt = SimpleNamespace(
        _parameter_list=[{"params": [_fake("w", "cpu", "pinned"), _fake("b", "gpu", "cpu")]},
                         {"params": [_fake("frozen", "cpu", stop_gradient=True),
                                     _fake("lost", "cpu")]}],
        _accumulators={"moment1": {"w": SimpleNamespace(place=_Place("gpu")),
                                   "b": SimpleNamespace(place=_Place("cpu"))}})
    rep = gpu_check.storage_report(opt)
    assert rep["bad"] == ["grad w: pinned", "param b: gpu", "accumulator moment1[w]: gpu"]
    assert (rep["params"], rep["grads"], rep["accumulators"], rep["no_grad"]) == (4, 2, 2, 1)
    assert gpu_check.place_kind(SimpleNamespace(place=object())) == "other"


# ------------------------------------------------------------------ rows, report, table
def test_parity_row_uses_the_workers_measure():
    ref = {"w": np.array([1.0, -2.0]), "b": np.array([0.5])}
    near = {"w": paddle.to_tensor([1.0, -2.0 + 1e-5]), "b": paddle.to_tensor([0.5])}
    row = gpu_check.parity_row("layout 1x2 (fleet)", near, ref, [3.0, 2.0], [3.0, 2.0], 1e-4, "x")
    assert row["status"] == "PASS" and "params 5.0e-06 (worst w)" in row["figures"]
    far = dict(near, b=paddle.to_tensor([0.6]))
    assert gpu_check.parity_row("l", far, ref, [3.0], [3.0], 1e-4, "x")["status"] == "FAIL"
    missing = gpu_check.parity_row("l", {"w": near["w"]}, ref, [3.0], [3.0], 1e-4, "x")
    assert missing["status"] == "FAIL" and "['b']" in missing["figures"]


def _rec(check, rank, outcome=None, where="forward", seconds=0.1, message=""):
    return {"check": check, "rank": rank, "outcome": outcome, "where": where,
            "seconds": seconds, "message": message}


def test_summarise_mismatch():
    check = gpu_check.MISMATCH_VARIANTS[0]
    both = [_rec(check, 0), _rec(check, 1), _rec(check, 0, "CollectiveMismatchError"),
            _rec(check, 1, "CollectiveMismatchError", seconds=0.25)]
    row = gpu_check.summarise_mismatch(check, both, 2)
    assert row["status"] == "PASS"
    assert "rank 1: CollectiveMismatchError in forward after 0.25 s" in row["figures"]
    silent = [_rec(check, 0, "CollectiveMismatchError"), _rec(check, 1, "no error")]
    assert gpu_check.summarise_mismatch(check, silent, 2)["status"] == "FAIL"
    started = [_rec(check, 0, "CollectiveMismatchError"), _rec(check, 1)]
    row = gpu_check.summarise_mismatch(check, started, 2)
    assert row["status"] == "FAIL" and "no outcome recorded" in row["figures"]
    row = gpu_check.summarise_mismatch(check, started, 2, {"1": (30, "all_gather on 'inner'")}, 30)
    assert row["status"] == "PASS"
    assert "rank 1: ended by the watchdog after 30 s (bound 30 s), waiting for all_gather" \
        in row["figures"]


WATCHDOG = ("paddle_hsdp watchdog (rank 1): paddle_hsdp: the all-gather tag flags (a host "
            "read: on NCCL it waits for the collectives queued before it, the last ones: "
            "all_gather on group 'inner') has not finished after 31 s "
            "(PADDLE_HSDP_COLLECTIVE_TIMEOUT=30): a rank of the group died or hangs.\n")


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_report_merges_launches_records_and_watchdog_lines(tmp_path, capsys):
    out = str(tmp_path)
    meta = {"world": 2, "gpu": "NVIDIA H200", "paddle": "3.3.1", "cuda": "12.6",
            "nccl": "2.21", "layout": "1x2", "steps": 5}
    main_rows = [gpu_check.row("layout 1x2 (fleet)", "PASS", "losses 1e-7"),
                 gpu_check.row("bf16 vs fp32", "PASS", "ok"),
                 gpu_check.row("overlap step time", "FAIL", "off/on 0.9x")]
    _write(f"{out}/results/main.json", json.dumps(
        {"meta": meta, "rows": main_rows, "planned": ["layout", "overlap", "bf16", "mismatch"],
         "done": ["layout", "overlap", "bf16"]}))  # ended in mismatch
    layouts = [gpu_check.row("layout 2x1 (fleet)", "PASS", "")]
    _write(f"{out}/results/layouts.json",
           json.dumps({"meta": dict(meta, layout="2x1"), "rows": layouts}))
    hang = gpu_check.HANG
    _write(f"{out}/results/mismatch.mismatch_hang.rank0.jsonl", "\n".join(json.dumps(r) for r in (
        dict(_rec(hang, 0), bound=30.0), _rec(hang, 0, "CollectiveMismatchError"))) + "\n")
    _write(f"{out}/results/mismatch.mismatch_hang.rank1.jsonl",
           json.dumps(dict(_rec(hang, 1), bound=30.0)) + "\n{\"half a li")
    _write(f"{out}/logs/mismatch_hang/workerlog.1", "I1201 noise\n" + WATCHDOG)
    _write(f"{out}/logs/mismatch_hang/rc", "1\n")  # expected there: not a FAIL
    _write(f"{out}/logs/offload_only/rc", "134\n")  # crashed before any result
    _write(f"{out}/logs/main/rc", "137\n")
    assert gpu_check.main(["--report", out]) == 1  # the overlap FAIL
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("gpu_check: 2 x NVIDIA H200, Paddle 3.3.1 (CUDA 12.6, NCCL 2.21), "
                               "fleet layout 1x2")
    checks = [line.split("  ")[0] for line in lines[3:] if line and not line.startswith(" ")]
    assert checks[:7] == ["layout 1x2 (fleet)", "layout 2x1 (fleet)", "overlap step time",
                          "bf16 vs fp32", "mismatch", "mismatch_hang (extra call)",
                          "launch offload_only"]
    assert "4 passed, 3 failed, 0 skipped" in text
    with open(f"{out}/gpu_check.json") as f:
        saved = {r["check"]: r for r in json.load(f)["rows"]}
    assert saved[hang]["status"] == "PASS", saved[hang]
    assert "rank 1: ended by the watchdog after 31 s (bound 30 s), waiting for paddle_hsdp: " \
           "the all-gather tag flags" in saved[hang]["figures"]
    assert "exit status 134 before any result" in saved["launch offload_only"]["figures"]
    assert "launch main ended before this check did (exit status 137)" \
        in saved["mismatch"]["figures"]


def test_report_of_an_empty_folder_says_so(tmp_path, capsys):
    assert gpu_check.main(["--report", str(tmp_path)]) == 1
    assert "no results" in capsys.readouterr().err


def test_table_wraps_figures_under_their_column():
    rows = [gpu_check.row("layout 1x2 (fleet)", "PASS", "word " * 40),
            gpu_check.row("profile", "SKIP", "no kernels")]
    table = gpu_check.format_table(rows, "header")
    lines = table.splitlines()
    assert lines[0] == "header" and lines[1].startswith("check ")
    column = lines[1].index("figures")
    assert lines[3][column:].startswith("word") and lines[4][:column].strip() == ""
    assert lines[-1] == "1 passed, 0 failed, 1 skipped"
    assert gpu_check.exit_status(rows) == 0
    assert gpu_check.exit_status(rows + [gpu_check.row("x", "FAIL", "")]) == 1
