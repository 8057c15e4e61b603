"""The checks against a reference: ``layout`` (fleet and mesh front ends against one
device), ``offload`` (pinned CPU offload against none, and where the optimizer's tensors
live) and ``bf16`` (against fp32)."""

from __future__ import annotations

from gpucheck.placement import storage_report
from gpucheck.run import PER_RANK, Run
from gpucheck.table import row

# fp32 parity, max |a - b| / max |b| per tensor (test_collective/workers/parity.py's
# measure). The CPU floor is 1e-6..2e-6 and the CPU bound 3e-5; GPU kernels differ with
# the batch shape (cuBLAS picks another algorithm for a half batch) and TF32 is turned
# off (NVIDIA_TF32_OVERRIDE=0). A first guess: set it from the first run's figures.
FP32_BOUND = 1e-4
BF16_LOSS_BOUND = 1e-2  # bf16 has 8 mantissa bits: ~4e-3 per rounding


def parity_row(name: str, full: dict, ref_params: dict, losses, ref_losses,
               bound: float, what: str) -> dict:
    """PASS when every parameter in both and the losses are within ``bound`` (the
    workers' measure, parity.max_rel: max |a - b| / max |b|)."""
    from parity import max_rel

    missing = sorted(set(ref_params) ^ set(full))
    diffs = {k: max_rel(full[k].numpy(), ref_params[k]) for k in ref_params if k in full}
    worst_key = max(diffs, key=diffs.get) if diffs else "-"
    params = diffs.get(worst_key, float("inf"))
    loss = max_rel(losses, ref_losses)
    ok = not missing and max(params, loss) <= bound
    figures = (f"losses {loss:.1e}, params {params:.1e} (worst {worst_key}) max rel vs "
               f"{what}; bound {bound:.0e}")
    if missing:
        figures += f"; keys not in both: {missing[:5]}"
    return row(name, "PASS" if ok else "FAIL", figures, losses=list(losses),
               reference_losses=list(ref_losses), params=diffs)


def check_layout(run: Run) -> list:
    import paddle_hsdp

    ref_losses, ref_params, _ = run.reference()
    rows = []
    for front, layout in (("fleet", run.layout), ("mesh", run.other)):
        kwargs = {} if front == "fleet" else {"mesh": run.mesh(layout)}
        model, opt = run.tinylm(**kwargs)
        losses = run.models.train_steps(model, opt, run.data(), run.rank, run.world, PER_RANK)
        full = paddle_hsdp.full_state_dict(model)
        rows.append(parity_row(f"layout {layout[0]}x{layout[1]} ({front})", full, ref_params,
                               losses, ref_losses, FP32_BOUND,
                               f"1 device, whole batch, fp32, {run.args.steps} steps"))
    return rows


def check_offload(run: Run) -> list:
    import paddle_hsdp

    data = run.data()
    base, base_opt = run.tinylm()
    base_losses = run.models.train_steps(base, base_opt, data, run.rank, run.world, PER_RANK)
    base_full = {k: v.numpy() for k, v in paddle_hsdp.full_state_dict(base).items()}
    model, opt = run.tinylm(offload_policy=paddle_hsdp.CPUOffloadPolicy(pin_memory=True))
    storage = {}

    def look(index):  # after the last step's opt.step(), before clear_grad
        if index == len(data) - 1:
            storage.update(storage_report(opt))

    losses = run.models.train_steps(model, opt, data, run.rank, run.world, PER_RANK,
                                    after_step=look)
    full = paddle_hsdp.full_state_dict(model)
    parity = parity_row("offload", full, base_full, losses, base_losses, FP32_BOUND,
                        "no offload")
    bad = storage["bad"]
    ok = parity["status"] == "PASS" and not bad
    figures = (f"{parity['figures']}; on a CPU place: {storage['params']} shards, "
               f"{storage['grads']} grads, {storage['accumulators']} accumulators; "
               f"{len(bad)} elsewhere{': ' + ', '.join(bad[:4]) if bad else ''}")
    if storage["no_grad"]:
        figures += f"; {storage['no_grad']} trainable shards without a grad"
    return [row("offload (pinned)", "PASS" if ok else "FAIL", figures,
                storage=storage, **parity["detail"])]


def check_bf16(run: Run) -> list:
    import numpy as np

    import paddle.nn.functional as F
    import paddle_hsdp

    paddle, models, rank = run.paddle, run.models, run.rank
    mp = paddle_hsdp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")
    curves, finite = {}, True
    for label, kwargs in (("fp32", {}), ("bf16", {"mp_policy": mp})):
        model, opt = run.tinylm(**kwargs)

        def micro_loss(micro, _, model=model):  # logits in float32 for the loss
            ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
            logits = model(ids[:, :-1], models.uses_extra(rank)).astype("float32")
            return F.cross_entropy(logits.reshape([-1, models.VOCAB]),
                                   ids[:, 1:].reshape([-1, 1]))

        curves[label] = run.common.train_loop(opt, run.data(), micro_loss,
                                              processes=run.world)
        full = paddle_hsdp.full_state_dict(model)
        finite &= all(np.isfinite(v.astype("float32").numpy()).all() for v in full.values())
    finite &= bool(np.isfinite(curves["bf16"]).all())
    diff = max(abs(a - b) / abs(b) for a, b in zip(curves["bf16"], curves["fp32"]))
    ok = finite and diff <= BF16_LOSS_BOUND
    figures = (f"losses max rel {diff:.1e} vs fp32 over {len(curves['fp32'])} steps (bound "
               f"{BF16_LOSS_BOUND:.0e}); {'no' if finite else 'SOME'} NaN/inf in losses and "
               f"params; last loss bf16 {curves['bf16'][-1]:.4f}, fp32 {curves['fp32'][-1]:.4f}")
    return [row("bf16 vs fp32", "PASS" if ok else "FAIL", figures, curves=curves)]
