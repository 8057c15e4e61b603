"""Paddle's own optimizer patterns over HSDP (issue 47), each against the unsharded
model trained in one process on the whole batch with the same optimizer: losses and
every parameter within workers/parity.py's bound. Run at 1 x 2 (the 2-rank launch)
and 2 x 2 (the shared 4-rank launch); argv: the layout as common.init_fleet takes it.

* an optimizer that overrides ``step`` and ``_apply_optimize`` without calling the
  base class (a hand-written SGD with a global-norm clip), float64: its grads are the
  synced ones and its clip the HSDP clip, though the step never reaches Paddle's
  ``_apply_optimize``;
* a Muon-style optimizer written the same way (momentum, quintic Newton-Schulz of each
  matrix) over ``Replicate()`` placements for the matrices, float64; on the default
  row shards it is refused at its first step, on every rank, nothing updated;
* ``MixPrecisionLayer`` / ``MixPrecisionOptimizer`` inside
  ``fleet.distributed_optimizer`` with ``ClipGradByGlobalNorm``, Momentum and AdamW,
  float32 (main_grad is float32): fleet's ``HybridParallelClipGrad`` lands on the
  optimizer under the wrapper, where the HSDP clip must replace it;
* parameter groups with a ``ClipGradByGlobalNorm`` (each group carries a copy of it),
  AdamW, float64, one micro-step and two;
* a full (unsharded) optimizer state dict given to ``set_state_dict`` is refused on
  every rank, naming the parameter and ``load_checkpoint``; the model trains on.

The clip is active at every step of every run (the reference's pre-clip norm over the
bound, asserted).
"""

import time

import numpy as np
from common import compare_with_reference, config_from_argv, finish, init_fleet
from parity import set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import Replicate, fleet
from paddle.distributed.fleet.utils.mix_precision_utils import (MixPrecisionLayer,
                                                                 MixPrecisionOptimizer)

import paddle_hsdp
from models import batches, build_model, decay_filter, lm_loss, shard_tinylm, uses_extra

STEPS, PER_RANK, CLIP = 3, 2, 0.2
started = time.time()
config = config_from_argv()
init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
LAYOUT = f"{config['outer']}x{config['sharding_degree'] // config['outer']}"


# ---------------------------------------------------------------- optimizers as users write them
class HandSGD(paddle.optimizer.Optimizer):
    """SGD that steps on ``p.grad`` itself: overrides ``step`` and ``_apply_optimize``
    without calling the base class (as hand-written optimizers and Paddle's Muon do)."""

    def __init__(self, learning_rate, parameters, grad_clip=None):
        super().__init__(learning_rate=learning_rate, parameters=parameters,
                         grad_clip=grad_clip)

    @paddle.no_grad()
    def step(self):
        pairs = [(p, p.grad) for p in self._parameter_list
                 if not p.stop_gradient and p.grad is not None]
        self._apply_optimize(None, None, pairs)

    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        if self._grad_clip is not None:
            params_grads = self._grad_clip(params_grads)
        for p, g in params_grads:
            p.set_value(p - self.update(p, g) * self.get_lr())

    def update(self, p, g):
        return g


class ToyMuon(HandSGD):
    """Muon's shape (momentum, then each matrix's quintic Newton-Schulz orthogonalisation
    scaled by its shape), written like HandSGD. A ``*Muon*`` class: paddle_hsdp takes it
    as needing whole matrices."""

    def __init__(self, learning_rate, parameters, grad_clip=None, momentum=0.9):
        super().__init__(learning_rate, parameters, grad_clip)
        self.momentum, self.buffers = momentum, {}

    def update(self, p, g):
        buf = self.buffers.get(p.name)
        buf = g.clone() if buf is None else buf * self.momentum + g
        self.buffers[p.name] = buf
        if len(p.shape) != 2:
            return buf
        return newton_schulz(buf) * max(1.0, p.shape[0] / p.shape[1]) ** 0.5


def newton_schulz(g, steps: int = 5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (paddle.linalg.norm(g) + 1e-7)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def matrices_whole(p):
    return Replicate() if len(p.shape) == 2 else None


def clip():
    return paddle.nn.ClipGradByGlobalNorm(CLIP)


def hand_sgd(model, params):
    return HandSGD(0.1, params, clip())


def toy_muon(model, params):
    return ToyMuon(0.05, params, clip())


def momentum(model, params):
    return paddle.optimizer.Momentum(0.05, parameters=params, grad_clip=clip())


def adamw(model, params):
    return paddle.optimizer.AdamW(0.05, parameters=params, weight_decay=0.1,
                                  apply_decay_param_fun=decay_filter(model), grad_clip=clip())


def adamw_groups(model, params):
    """Two parameter groups, each with its own copy of the clip (Paddle's setdefault)."""
    params = list(params)
    keep = decay_filter(model)
    groups = [{"params": [p for p in params if keep(p.name)], "weight_decay": 0.1},
              {"params": [p for p in params if not keep(p.name)], "weight_decay": 0.0}]
    return paddle.optimizer.AdamW(0.05, parameters=groups, grad_clip=clip())


# ---------------------------------------------------------------- one run and its reference
def trained(make_opt, data, sharded: bool, master_grad=False, fleet_opt=False,
            placement=None):
    """TinyLM trained on ``data``: sharded here (this rank's rows), or unsharded on the
    whole batch in one process. Returns (losses, full params, pre-clip norms)."""
    model = build_model()
    if sharded:
        shard_tinylm(model, **({"shard_placement_fn": placement} if placement else {}))
    net = MixPrecisionLayer(model, dtype="bfloat16") if master_grad else model
    opt = make_opt(model, model.parameters())
    if master_grad:
        opt = MixPrecisionOptimizer(opt)
    if fleet_opt:
        opt = fleet.distributed_optimizer(opt)
    losses, norms = [], []
    for micro_batches in data:
        total = 0.0
        for micro in micro_batches:
            chunks = [rank] if sharded else range(world)
            loss = sum(lm_loss(net, paddle.to_tensor(micro[r * PER_RANK:(r + 1) * PER_RANK]),
                               uses_extra(r)) for r in chunks) / len(chunks)
            (loss / len(micro_batches)).backward()
            value = paddle.to_tensor([float(loss)], dtype="float64")
            if sharded:
                dist.all_reduce(value)  # for the log only
            total += value.item() / (world if sharded else 1) / len(micro_batches)
        if not sharded:
            grads = [getattr(p, "main_grad", None) if master_grad else p.grad
                     for p in model.parameters() if not p.stop_gradient]
            norms.append(sum(float((g.astype("float64") ** 2).sum())
                             for g in grads if g is not None) ** 0.5)
        opt.step()
        opt.clear_grad()
        losses.append(total)
    full = paddle_hsdp.full_state_dict(model) if sharded else {
        n: p.numpy() for n, p in model.state_dict().items()}
    return losses, full, norms


def check(name, make_opt, micro=1, dtype="float64", **kwargs):
    set_dtype(dtype)
    data = batches(STEPS, micro, world, PER_RANK, seed=11)
    ref_losses, ref_params, norms = trained(make_opt, data, False,
                                            master_grad=kwargs.get("master_grad", False))
    assert min(norms) > CLIP, (name, norms)  # the clip is active at every step
    losses, full, _ = trained(make_opt, data, True, **kwargs)
    measured = compare_with_reference(f"optimizer patterns {name} {LAYOUT}", full, ref_params,
                                      losses, ref_losses, {})
    print(f"OPT_PATTERNS {name} {LAYOUT}: max rel diff {measured:.2e}", flush=True)


def refused(name, error, fragment, fn):
    try:
        fn()
    except error as e:
        assert fragment in str(e), (name, str(e))
        print(f"OPT_PATTERNS refused {name} {LAYOUT}: {e}", flush=True)
        return
    raise AssertionError(f"{name} was not refused")


def muon_on_row_shards():
    """A whole-matrix optimizer over the default row shards: refused at its first step,
    before any update, on every rank alike (the layout decides)."""
    set_dtype("float64")
    model = shard_tinylm(build_model())
    before = {n: t.numpy().copy() for n, t in paddle_hsdp.full_state_dict(model).items()}
    opt = toy_muon(model, model.parameters())
    lm_loss(model, paddle.to_tensor(batches(1, 1, world, PER_RANK)[0][0][
        rank * PER_RANK:(rank + 1) * PER_RANK]), uses_extra(rank)).backward()
    refused("muon_on_row_shards", NotImplementedError, "Replicate()", opt.step)
    opt.clear_grad()
    after = paddle_hsdp.full_state_dict(model)
    assert all(np.array_equal(before[n], after[n].numpy()) for n in before)


def full_optimizer_state():
    """A full optimizer state dict (the unsharded model's, before sharding) given to
    the sharded optimizer: refused naming a parameter, and the model trains on."""
    set_dtype("float64")
    model = build_model()
    plain = adamw(model, model.parameters())
    lm_loss(model, paddle.to_tensor(batches(1, 1, 1, PER_RANK)[0][0]), True).backward()
    plain.step()  # local only: no collective
    full_state = plain.state_dict()
    shard_tinylm(model)
    opt = adamw(model, model.parameters())
    refused("full_optimizer_state", ValueError, "load_checkpoint",
            lambda: opt.set_state_dict(full_state))
    ids = batches(1, 1, world, PER_RANK)[0][0][rank * PER_RANK:(rank + 1) * PER_RANK]
    lm_loss(model, paddle.to_tensor(ids), uses_extra(rank)).backward()
    opt.step()  # still usable
    opt.clear_grad()


check("hand_sgd", hand_sgd)
check("toy_muon_replicated", toy_muon, placement=matrices_whole)
muon_on_row_shards()
check("master_grad_fleet_momentum", momentum, dtype="float32", master_grad=True,
      fleet_opt=True)
check("master_grad_fleet_adamw", adamw, dtype="float32", master_grad=True, fleet_opt=True)
check("param_groups", adamw_groups)
check("param_groups_accumulated", adamw_groups, micro=2)
full_optimizer_state()
print(f"OPT_PATTERNS {LAYOUT} done in {time.time() - started:.1f} s", flush=True)
finish()
