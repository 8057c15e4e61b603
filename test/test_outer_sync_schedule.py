"""The outer-sync schedule's prediction of a step's last backward (engine/outer_sync.py),
where paddle_hsdp.ft asks it to record anew: no backward of that step syncs early, also
with several backwards per step (a replica sitting the step out zeroes its grads before
they are synced)."""

from paddle_hsdp.engine import outer_sync
from paddle_hsdp.engine.outer_sync import OuterSyncSchedule


def run_step(schedule, backwards):
    """The states each backward of one step begins in; then the step is taken."""
    seen = []
    for _ in range(backwards):
        schedule.begin_backward()
        seen.append(schedule.state)
        schedule.end_backward(None, [])
    schedule.step_taken()
    return seen


def test_after_record_again_no_backward_of_the_step_syncs_early(monkeypatch):
    monkeypatch.setattr(outer_sync, "ENABLED", True)
    monkeypatch.setattr(outer_sync, "agreed_order", lambda order, group, buffers: order)
    schedule = OuterSyncSchedule()
    early = outer_sync.SyncSchedule.EARLY
    run_step(schedule, 2)  # records, and learns a step has 2 backwards
    assert run_step(schedule, 2)[-1] is early  # predicted: the last syncs early
    schedule.record_again()
    assert early not in run_step(schedule, 2)  # the step after a round: none early
    assert run_step(schedule, 2)[-1] is early  # then as before
