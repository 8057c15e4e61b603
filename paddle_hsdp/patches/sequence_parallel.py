"""Sequence parallel's gradient all-reduce on HSDP-managed parameters, whichever order
the user registers Paddle's hooks in (before or after ``fully_shard``), fused or not.

Under sequence parallelism each tensor-parallel (mp) rank runs the layers outside the
mp layers (norms, some biases: parameters marked ``sequence_parallel``) on its part of
the sequence, so such a parameter's gradient is the **sum over the mp group** of every
rank's part. Paddle's ``register_sequence_parallel_allreduce_hooks(model, k, fused)``
hangs a post-accumulation hook on each marked parameter that all-reduces ``param.grad``
over the mp group at every k-th backward (``fused``: one hook for all of them, one
coalesced all-reduce once every parameter fired k times). On HSDP's parameters neither
can be right:

* called after ``fully_shard``, the hooks sit on the shards, which autograd never gives
  a gradient (the engine writes their grads): no all-reduce at all, silently wrong
  (losses 2.2e-3 and parameters 0.22 off after 4 steps, measured);
* called before, the hooks sit on the full parameters, whose grads HSDP reduce-scatters
  and frees after **each** backward: at the k-th backward only that backward's part is
  there (right only for k = 1); and the fused hook (whose fused all-reduce the guard of
  :mod:`.fleet` points away from HSDP's parameters) sums nothing; in Paddle 3.3 it
  also takes an argument ``_register_backward_hook`` never passes (a ``TypeError``).

So paddle_hsdp patches the two hook factories that Paddle's function calls (looked up
at call time, so PaddleFormers' Trainer and scripts that imported the function are
covered). Each marked parameter's autograd parameter (the full one: a shard's original)
gets a gradient hook (``Tensor.register_hook``) that, once HSDP manages the parameter,
all-reduces **each incoming gradient** over the mp group before it is accumulated,
hence before HSDP reads it. A sum over mp ranks commutes with the sharding group's
reduce-scatter, the outer all-reduce and the 1/N scaling, so the shard grads end up as
the mp sum of the data-parallel mean, for any number of accumulation steps, with
``set_requires_gradient_sync(False)`` and with activation recompute. The cost is one
mp all-reduce per marked parameter per backward (full size, as Paddle's non-fused hook
with k = 1): norms and biases, small. Paddle's own hooks, still registered, do nothing
for a parameter HSDP manages; parameters HSDP does not manage keep Paddle's behaviour
(the fused hook then accepts whatever arguments it gets, so it runs instead of
raising). A parameter hooked twice is summed once.

PaddleFormers' ``Trainer`` has a second route (``SPGradSyncCallback``, when its own
sharding is not stage 2 or 3): at the optimizer's start, Paddle's fused all-reduce of
the marked parameters over the mp group, which :mod:`.fleet`'s guard points away from
HSDP's parameters (it is there for data-parallel groups, where HSDP reduces itself).
Over the mp group that guard hands HSDP's parameters to :func:`sum_shard_grads`: the
step's grad sync finishes first (so no reduce-scatter is left for later), then each
shard's grad is all-reduced over mp in place (every mp rank holds the same rows).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, TypeGuard

import paddle
from paddle import Tensor
from paddle.distributed import fleet
from paddle.distributed.communication.group import Group
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

from ..comm import collectives as comm
from ..engine.optimizers import managed_shards, finish_grad_sync
from ..engine.registry import managed_param
from .patching import replace

_installed = False
_WATCHED = "_hsdp_sequence_parallel_hook"  # set on a full parameter once it has our hook


def _mp_group() -> Group:
    return fleet.get_hybrid_communicate_group().get_model_parallel_group()


def is_mp_group(group: Group | None) -> TypeGuard[Group]:
    """Whether ``group`` is fleet's tensor-parallel group (of more than one rank)."""
    try:
        mp = _mp_group()
    except (AttributeError, AssertionError):  # fleet is not initialised: no mp group
        return False
    return group is not None and group.nranks > 1 and group.id == mp.id


def sum_shard_grads(params: Iterable[Tensor], group: Group, scale: float) -> None:
    """Paddle's fused all-reduce over the mp group, for HSDP parameters: finish the
    step's grad sync of their units, then scale each shard's grad (its ``main_grad``
    under Paddle's master-grad wrapper) by ``scale`` and sum it over ``group`` in
    place. Every mp rank holds the same shards, so every rank makes the same calls."""
    shards = managed_shards(params)
    finish_grad_sync(shards)
    for shard in shards:
        grad = getattr(shard, "main_grad", None)
        grad = shard.grad if grad is None else grad
        if grad is None:
            continue
        if scale != 1.0:
            grad.scale_(scale)
        comm.all_reduce(grad, group, tag="sequence_parallel")


def autograd_param(param: Tensor) -> Tensor:
    """The parameter autograd gives gradients to: a shard's original, else ``param``."""
    sp = managed_param(param)
    return sp.full if sp is not None else param


def sum_over_mp(full: Tensor, group: Group, grad: Tensor) -> Tensor:
    """The gradient hook: each incoming grad of an HSDP-managed parameter summed over
    the mp group; any other parameter's grad as it is (Paddle's hook sums it)."""
    if managed_param(full) is None:
        return grad
    with paddle.no_grad():  # see [Note: engine work without autograd] (engine/hooks.py)
        summed = grad.clone()
        comm.all_reduce(summed, group, tag="sequence_parallel")
    return summed


def watch(param: Tensor) -> None:
    """Give ``param``'s autograd parameter the mp sum of its incoming grads (once)."""
    full = autograd_param(param)
    if getattr(full, _WATCHED, False):
        return
    group = _mp_group()
    full.register_hook(lambda grad: sum_over_mp(full, group, grad))
    setattr(full, _WATCHED, True)


def _patch_non_fused() -> None:
    original = spu.create_non_fused_allreduce_gradient_hook

    def create_non_fused_allreduce_gradient_hook(param: Tensor, accumulation_steps: int,
                                                 ) -> Callable[..., Any]:
        watch(param)
        paddle_hook = original(param, accumulation_steps)

        def hook(*args: Any) -> Any:
            if managed_param(param) is None:  # not HSDP's: Paddle's all-reduce
                return paddle_hook(*args)
            return None
        return hook

    replace(spu, "create_non_fused_allreduce_gradient_hook",
            create_non_fused_allreduce_gradient_hook,
            "sequence parallel on HSDP parameters: each backward's grad summed over mp "
            "before HSDP reduces it (a hook on a shard never fires)")


def _patch_fused() -> None:
    def create_fused_allreduce_gradient_hook(parameter_list: Iterable[Tensor],
                                             accumulation_steps: int) -> Callable[..., None]:
        params = list(parameter_list)
        for p in params:
            watch(p)
        # autograd never fires a hook registered on a shard: count the others' calls
        firing = sum(1 for p in params if not hasattr(p, "_hsdp_sharded_param"))
        calls = [0]

        def hook(*_: Any) -> None:  # Paddle 3.3's own takes ``grad``, which it is never given
            calls[0] += 1
            if calls[0] < accumulation_steps * firing:
                return
            calls[0] = 0
            rest = [p for p in params if managed_param(p) is None]
            if rest:  # HSDP's were summed as their grads arrived (watch)
                spu.fused_allreduce_gradients_with_group(rest, group=_mp_group(), scale=1.0)
        return hook

    replace(spu, "create_fused_allreduce_gradient_hook", create_fused_allreduce_gradient_hook,
            "sequence parallel on HSDP parameters, fused: each grad summed over mp as it "
            "arrives; the rest as Paddle's (whose hook raises on its missing argument)")


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_non_fused()
    _patch_fused()
    _installed = True
