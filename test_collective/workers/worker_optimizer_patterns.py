"""Paddle's own optimizer patterns over HSDP (issue 47), each against the unsharded
model trained in one process on the whole batch with the same optimizer: losses and
every parameter within workers/parity.py's bound. Run at 1 x 2 (the 2-rank launch)
and 2 x 2 (the shared 4-rank launch); argv: the layout as common.init_fleet takes it.

* an optimizer that overrides ``step`` and ``_apply_optimize`` without calling the
  base class (a hand-written SGD with a global-norm clip), float64: its grads are the
  synced ones and its clip the HSDP clip, though the step never reaches Paddle's
  ``_apply_optimize``;
* a Muon-style optimizer written the same way (momentum, quintic Newton-Schulz of each
  matrix) over ``Replicate()`` placements for the matrices, float64, and over the
  default row shards, which its first step moves onto owners (issue 64);
* ``MixPrecisionLayer`` / ``MixPrecisionOptimizer`` inside
  ``fleet.distributed_optimizer`` with ``ClipGradByGlobalNorm``, Momentum and AdamW,
  float32 (main_grad is float32): fleet's ``HybridParallelClipGrad`` lands on the
  optimizer under the wrapper, where the HSDP clip must replace it;
* parameter groups with a ``ClipGradByGlobalNorm`` (each group carries a copy of it),
  AdamW, float64, one micro-step and two;
* a full (unsharded) optimizer state dict given to ``set_state_dict``: each rank keeps
  its rows, ``full_optimizer_state_dict`` gives it back exactly, the model trains on.

The clip is active at every step of every run (the reference's pre-clip norm over the
bound, asserted).
"""

import time

import numpy as np
from common import compare_with_reference, config_from_argv, finish, init_fleet
from parity import set_dtype

import paddle
from paddle.utils import unique_name
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


def full_optimizer_state():
    """A full optimizer state dict (the unsharded model's, before sharding) given to
    the sharded optimizer: each rank keeps its rows (issue 64), the full state taken
    back out is the one that went in, and the model trains on."""
    set_dtype("float64")
    # (Paddle matches accumulators by their generated names: each optimizer names them
    # in a fresh guard, as a new process would)
    with unique_name.guard():
        model = build_model()
        plain = adamw(model, model.parameters())
        lm_loss(model, paddle.to_tensor(batches(1, 1, 1, PER_RANK)[0][0]), True).backward()
        plain.step()  # local only: no collective
    full_state = {k: v.numpy().copy() if hasattr(v, "numpy") else v
                  for k, v in plain.state_dict().items()}
    shard_tinylm(model)
    with unique_name.guard():
        opt = adamw(model, model.parameters())
        opt.set_state_dict({k: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v
                            for k, v in full_state.items()})
    back = paddle_hsdp.full_optimizer_state_dict(model, opt)
    moments = [k for k, v in full_state.items() if isinstance(v, np.ndarray) and v.size > 1]
    assert moments and all(np.array_equal(back[k].numpy(), full_state[k]) for k in moments)
    ids = batches(1, 1, world, PER_RANK)[0][0][rank * PER_RANK:(rank + 1) * PER_RANK]
    lm_loss(model, paddle.to_tensor(ids), uses_extra(rank)).backward()
    opt.step()  # trains on
    opt.clear_grad()
    print(f"OPT_PATTERNS loaded full_optimizer_state {LAYOUT}: {len(moments)} moments "
          "back exactly", flush=True)


check("hand_sgd", hand_sgd)
check("toy_muon_replicated", toy_muon, placement=matrices_whole)
# the default row shards: its first step moves the matrices onto owners (issue 64)
check("toy_muon_moved", toy_muon)
check("master_grad_fleet_momentum", momentum, dtype="float32", master_grad=True,
      fleet_opt=True)
check("master_grad_fleet_adamw", adamw, dtype="float32", master_grad=True, fleet_opt=True)
check("param_groups", adamw_groups)
check("param_groups_accumulated", adamw_groups, micro=2)
full_optimizer_state()
print(f"OPT_PATTERNS {LAYOUT} done in {time.time() - started:.1f} s", flush=True)
finish()
