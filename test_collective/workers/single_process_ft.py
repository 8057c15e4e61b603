"""The single-process reference of the fault-tolerance test: step t trains on the
batches of the replicas live at step t (as every replica recorded it), the mean loss
over their ranks' rows; then every rank's committed losses and every replica's final
parameters are compared with it (float64, the parity bound of workers/parity.py):
each as of the step it was written at (``params_step``: a job that saved, stopped and
resumed wrote them at the save too). A joint checkpoint out_dir/ckpt is loaded into
one process and compared with the reference at its step (its ``extra``).

argv: the folder worker_ft.py wrote into, the number of steps, the ranks per replica
(default 2), the penalty on the parameters' squared norm (worker_ft.py's
FT_TEST_PENALTY, default 0) and the fewest groups a step has it with
(FT_TEST_PENALTY_MIN_GROUPS, default 0); the optimizer is the one the replicas recorded. Prints the membership per step and FT_PARITY_OK.
A run that synced every H steps (DiLoCo, FT_TEST_DILOCO) is checked against
reference_ft_diloco.py instead.
"""

import glob
import json
import os
import sys

from ft_common import (RANKS_PER_REPLICA, batch, build_model, diffs_against, loss_of,
                       make_optimizer, penalty_of)
from parity import max_rel, report, set_dtype

import paddle

out_dir, steps = sys.argv[1], int(sys.argv[2])
ranks_per_replica = int(sys.argv[3]) if len(sys.argv) > 3 else RANKS_PER_REPLICA
penalty = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
penalty_min_groups = int(sys.argv[5]) if len(sys.argv) > 5 else 0
set_dtype("float64")
runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out_dir}/replica*_rank*.json"))]
assert runs, f"no replica wrote its results into {out_dir}"

# the replicas of each committed step, as every rank recorded it: they must agree
members: dict[int, list[int]] = {}
for run in runs:
    for entry in run["history"]:
        if entry["kind"] == "step":
            t = entry["step"] - 1
            assert members.setdefault(t, entry["replicas"]) == entry["replicas"], (
                f"replica {run['replica']} rank {run['rank']} trained step {t + 1} with "
                f"replicas {entry['replicas']}, another rank with {members[t]}")
assert sorted(members) == list(range(steps)), f"steps without a record: {sorted(members)}"
print("MEMBERS " + json.dumps({t + 1: members[t] for t in range(steps)}), flush=True)

everies = {run.get("diloco", 1) for run in runs}
assert len(everies) == 1, f"the replicas synced every {everies} steps"
every = everies.pop()
if every > 1:  # DiLoCo on replica groups: one model per group, its own reference
    from reference_ft_diloco import check_diloco
    check_diloco(runs, members, every, steps, ranks_per_replica)
    sys.exit(0)

kinds = {run.get("optimizer", "adamw") for run in runs}
assert len(kinds) == 1, f"the replicas trained with different optimizers: {kinds}"
kind = kinds.pop()
model = build_model()
opt, scheduler = make_optimizer(model.parameters(), kind)
checkpoint = os.path.join(out_dir, "ckpt")
checkpoint_step = None
if os.path.isdir(checkpoint):
    import paddle_hsdp
    checkpoint_step = paddle_hsdp.checkpoint.read_metadata(checkpoint)["extra"]["step"]
params_at = {run.get("params_step", steps) for run in runs}
want_params_at: dict[int, dict] = {}  # step -> the reference's parameters after it
ckpt_diffs = {}
want_losses: dict[tuple, float] = {}  # (step, replica, rank) -> loss before the update
for t in range(steps):
    per_rank = []
    for replica in members[t]:
        for rank in range(ranks_per_replica):
            loss = loss_of(model, *batch(t, replica, rank))
            want_losses[(t, replica, rank)] = float(loss)
            per_rank.append(loss)
    mean = paddle.add_n(per_rank) / len(per_rank)  # equal rows: the global mean
    penalised = penalty and len(members[t]) >= penalty_min_groups
    (mean + penalty_of(model, penalty) if penalised else mean).backward()
    opt.step()
    scheduler.step()
    opt.clear_grad()
    if t + 1 in params_at:
        want_params_at[t + 1] = {k: v.numpy() for k, v in model.state_dict().items()}
    if t + 1 == checkpoint_step:  # the live groups' joint checkpoint, loaded into one process
        from paddle_hsdp.engine.optimizers import states_of
        loaded = build_model()
        loaded_opt, _ = make_optimizer(loaded.parameters(), kind)
        extra = paddle_hsdp.load_checkpoint(checkpoint, loaded, loaded_opt)
        assert extra == {"step": t + 1}, extra
        for (name, want), got in zip(model.named_parameters(), loaded.parameters()):
            ckpt_diffs[name] = max_rel(got.numpy(), want.numpy())
            want_states, got_states = states_of(opt, want), states_of(loaded_opt, got)
            assert sorted(want_states) == sorted(got_states), (sorted(want_states),
                                                               sorted(got_states))
            for acc, value in want_states.items():
                ckpt_diffs[f"{name} {acc}"] = max_rel(got_states[acc].numpy(), value.numpy())

loss_diffs, param_diffs = diffs_against(
    runs, want_losses, lambda run: want_params_at[run.get("params_step", steps)])
report("ft: per-step losses of every rank vs the reference", loss_diffs)
report("ft: final parameters of every replica vs the reference", param_diffs)
if checkpoint_step is not None:
    assert ckpt_diffs, f"the checkpoint's step {checkpoint_step} is not one of 1..{steps}"
    report("ft: the live groups' checkpoint (model and optimizer) vs the reference",
           ckpt_diffs)
    print(f"FT_CHECKPOINT_OK {len(ckpt_diffs)} tensors", flush=True)
print(f"FT_PARITY_OK ({kind}) {len(loss_diffs)} losses, {len(param_diffs)} parameters", flush=True)
