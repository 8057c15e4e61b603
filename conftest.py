"""The suite's temporary files: one folder per run, removed when the run ends.

Every launch, checkpoint and log the tests write goes under ``tempfile.gettempdir()``
(the launches' ranks inherit ``TMPDIR``), so pointing both at one folder made here and
removing it at the end leaves nothing behind, passed or failed: a suite that left its
folders in /tmp filled a disk after a few dozen runs. ``HSDP_KEEP_TEST_FILES=1`` keeps
the folder (its path is printed) to read the ranks' logs after a failure.
"""

import os
import shutil
import tempfile

import pytest

run_folder = pytest.StashKey[tuple[str, "str | None"]]()


def pytest_configure(config: pytest.Config) -> None:
    folder = tempfile.mkdtemp(prefix="paddle_hsdp_tests_")
    config.stash[run_folder] = (folder, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    folder, before = config.stash[run_folder]
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    if os.environ.get("HSDP_KEEP_TEST_FILES") == "1":
        print(f"\nthe tests' files are kept in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
