"""The command lines a user types: bad flags and --help answered at once, once, before
any rank starts; the checkpoint CLI without runpy's warning; consolidate into a folder
that does not exist yet."""

import os
import subprocess
import sys

import paddle

from paddle_hsdp import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_demo_help_prints_the_flags_and_starts_nothing():
    proc = _run("bash", "tools/demo.sh", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--steps" in proc.stdout and "--layout" in proc.stdout
    assert "launching" not in proc.stdout


def test_demo_bad_flag_is_reported_once_before_any_rank_starts():
    proc = _run("bash", "tools/demo.sh", "--bogus")
    assert proc.returncode == 2
    assert (proc.stdout + proc.stderr).count("unrecognized arguments: --bogus") == 1
    assert "launching" not in proc.stdout


def test_checkpoint_cli_runs_without_a_runpy_warning():
    proc = _run(sys.executable, "-m", "paddle_hsdp.checkpoint", "--help")
    assert proc.returncode == 0 and "inspect" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr, proc.stderr[-2000:]


def test_consolidate_makes_the_output_folder(tmp_path, capsys):
    checkpoint.save_checkpoint(tmp_path / "ck", paddle.nn.Linear(3, 2))
    out = tmp_path / "new" / "folder" / "full.safetensors"
    assert checkpoint.main(["consolidate", str(tmp_path / "ck"), str(out)]) == 0
    assert out.is_file() and "wrote 2 tensors" in capsys.readouterr().out
    # an output that cannot be written is one line, not a traceback
    (tmp_path / "afile").write_text("x")
    assert checkpoint.main(["consolidate", str(tmp_path / "ck"),
                            str(tmp_path / "afile" / "full.safetensors")]) == 1
    assert capsys.readouterr().out.startswith("error: ")
