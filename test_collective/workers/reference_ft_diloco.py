"""The single-process reference of DiLoCo on fault-tolerant replica groups
(single_process_ft.py hands a run that synced every H steps to :func:`check_diloco`):
one model, AdamW and scheduler per replica group, on plain Paddle, float64.

Step t (1-based) of the live groups ``members[t]``: first each group that joined at t
takes its donor's inner optimizer state and scheduler and, as its params, the last
synced model (the anchor); then, if t - 1 is a multiple of H (the sync step t - 1
owes, run by step t's attempt), the live groups' mean pseudo-gradient (anchor minus
params) goes through the outer Nesterov step and every live group takes the new
anchor; then every live group trains its own batches (the mean over its ranks' rows,
clipped by its own norm). A group that died is left as it was. The sync step ``steps``
owes is not run (no attempt follows it). Compares every rank's losses and every
group's final parameters (parity bound) and prints FT_PARITY_OK.
"""

import paddle

from ft_common import DILOCO, batch, build_model, diffs_against, loss_of, make_optimizer
from parity import report
from paddle_hsdp.engine.optimizers import states_of


class Group:
    """One replica group's model, optimizer and scheduler."""

    def __init__(self):
        self.model = build_model()
        self.opt, self.scheduler = make_optimizer(self.model.parameters())

    def take(self, donor, anchor):
        """A rejoin: the donor's inner state, the anchor as params."""
        for mine, theirs in zip(self.model.parameters(), donor.model.parameters(), strict=True):
            for name, value in states_of(donor.opt, theirs).items():
                states_of(self.opt, mine)[name].set_value(value.clone())
        self.scheduler.set_state_dict(donor.scheduler.state_dict())
        self.set_params(anchor)

    def params(self):
        return [p.numpy().copy() for p in self.model.parameters()]

    def set_params(self, values):
        for p, v in zip(self.model.parameters(), values, strict=True):
            p.set_value(v.copy())


def donors_by_step(runs):
    """``{step: {joiner: donor}}`` as the replicas' round records say."""
    found = {}
    for run in runs:
        for entry in run["history"]:
            if entry["kind"] == "step" and entry.get("donors"):
                found.setdefault(entry["step"], {}).update(
                    {int(r): d for r, d in entry["donors"].items()})
    return found


def sync(groups, live, anchor, momentum):
    """The outer Nesterov step on the live groups' mean pseudo-gradient."""
    deltas = [[a - p for a, p in zip(anchor, groups[r].params(), strict=True)] for r in live]
    mean = [sum(d[i] for d in deltas) * (1.0 / len(live)) for i in range(len(anchor))]
    mu, lr = DILOCO["momentum"], DILOCO["lr"]
    momentum = [mu * m + g for m, g in zip(momentum, mean, strict=True)]
    anchor = [a - lr * (g + mu * m) for a, g, m in zip(anchor, mean, momentum, strict=True)]
    for r in live:
        groups[r].set_params(anchor)
    return anchor, momentum


def simulate(runs, members, every, steps, ranks, rejoin_takes="anchor", undo=True):
    """The reference's losses ``{(step, replica, rank): loss}`` and parameters
    ``{(step, replica): {name: value}}``. What the checks must tell apart:
    ``rejoin_takes="donor"`` (a rejoiner takes the donor's params, not the anchor) and
    ``undo=False`` (a sync whose attempt failed is kept: over the groups live before).
    """
    donors = donors_by_step(runs)
    groups = {r: Group() for t in members for r in members[t]}
    anchor = groups[members[0][0]].params()
    momentum = [0.0 * a for a in anchor]
    want_losses, want_params = {}, {}
    before = []
    for t in range(steps):
        live = members[t]
        for r in live:
            if r not in before and t > 0:
                donor = groups[donors[t + 1][r]]
                groups[r].take(donor, anchor if rejoin_takes == "anchor" else donor.params())
        if t and t % every == 0:
            anchor, momentum = sync(groups, live if undo else members[t - 1], anchor, momentum)
        for r in live:
            group, losses = groups[r], []
            for rank in range(ranks):
                loss = loss_of(group.model, *batch(t, r, rank))
                want_losses[(t, r, rank)] = float(loss)
                losses.append(loss)
            (paddle.add_n(losses) / len(losses)).backward()
            group.opt.step()
            group.scheduler.step()
            group.opt.clear_grad()
            want_params[(t + 1, r)] = {k: v.numpy() for k, v in group.model.state_dict().items()}
        before = live
    return want_losses, want_params


def check_diloco(runs, members, every, steps, ranks):
    def params_of(table):
        return lambda run: table[(run.get("params_step", steps), run["replica"])]

    want_losses, want_params = simulate(runs, members, every, steps, ranks)
    loss_diffs, param_diffs = diffs_against(runs, want_losses, params_of(want_params))
    report("ft diloco: per-step losses of every rank vs the reference", loss_diffs)
    report("ft diloco: final parameters of every group vs the reference", param_diffs)
    # the checks can fail: the run is far from the rules it must not follow
    for wrong in ({"rejoin_takes": "donor"}, {"undo": False}):
        losses, params = simulate(runs, members, every, steps, ranks, **wrong)
        apart = max(diffs_against(runs, losses, params_of(params))[1].values())
        assert apart > 1e-6, (wrong, apart)
        print(f"FT_DILOCO_APART {wrong}: {apart:.1e}", flush=True)
    print(f"FT_PARITY_OK (diloco every {every}) {len(loss_diffs)} losses, "
          f"{len(param_diffs)} parameters", flush=True)
