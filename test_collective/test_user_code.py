"""Ordinary training code that went silently wrong (issue 31), on HSDP 2 x 2 in the
shared 4-rank launch (workers/worker_user_code.py), each against a single-process
reference in float64: in-place parameter edits (HSDP and HFSDP), a root-held head one
replica uses, untouched parameters, penalties on ``model.parameters()``, ``retain_graph``
refused, ``step()`` without ``clear_grad()``, a forward without backward, the resident
set over 200 steps after 60 of warm-up, and a unit skipped on some ranks named at step 0
and step 2."""

import pytest

from launcher import part_of

PARITY = ["edits none", "edits optim", "replica_head none", "replica_head optim",
          "penalty none", "penalty optim", "no_clear_grad none", "no_clear_grad optim",
          "untouched", "retain_graph refused, then trains",
          "skip_mismatch from step 0, then trains", "skip_mismatch from step 2, then trains"]


@pytest.fixture(scope="module")
def log(hsdp_2x2_log):
    return part_of(hsdp_2x2_log, "worker_user_code.py")


@pytest.mark.parametrize("name", PARITY)
def test_matches_the_single_process_reference(log, name):
    assert f"USER_CODE {name} max rel diff" in log, log[-3000:]


def test_a_forward_without_backward_leaves_nothing_gathered(log):
    assert "USER_CODE skipped_backward gathered at peak" in log, log[-3000:]


def test_200_steps_grow_no_faster_than_plain_paddle(log):
    assert "USER_CODE growth per step over 200 steps" in log, log[-3000:]


@pytest.mark.parametrize("step", [0, 2])
def test_a_unit_skipped_on_some_ranks_is_named(log, step):
    assert f"USER_CODE skip_mismatch step {step}: CollectiveMismatchError" in log, log[-3000:]
