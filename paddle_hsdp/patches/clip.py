"""Global-norm clipping over HSDP shards: every distinct gradient element counted once.

Patches ``paddle.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` (:func:`install`): on
shards Paddle's would compute each rank's norm of its own rows and clip stale grads. At
the step boundary (:mod:`.optim`) a plain ``ClipGradByGlobalNorm`` of the optimizer is
swapped for :class:`HSDPClipGradByGlobalNorm`, and so is the ``HybridParallelClipGrad``
``fleet.distributed_optimizer`` puts there (:mod:`.optim`).

What a rank holds, and who else holds the same values:

* inner ranks hold distinct row blocks of a buffer;
* outer replicas hold copies: every outer rank but 0 marks its shards
  ``is_firstly_shared=False`` (see ``ShardBuffer``), as Paddle's pipeline code marks
  the second copy of a shared weight;
* tensor-parallel ranks hold distinct slices of ``is_distributed`` params and copies
  of the rest; sep ranks hold copies of everything;
* pipeline stages hold distinct layers.

So the squared norm is a sum of local terms where a term counts only on its first copy
(``is_firstly_shared`` not False, and mp rank 0 unless ``is_distributed``, and sep rank
0), followed by **one all-reduce over the whole job** (HSDP runs with ``dp_degree=1``,
so the world is pp x sharding x sep x mp). No rank returns early: a rank with nothing
to count (an outer replica, an all-padding shard, experts that got no tokens) adds zero
and still joins the all-reduce, so no rank hangs.

Paddle's own ``HybridParallelClipGrad`` (what ``fleet.distributed_optimizer`` installs)
reads the same ``is_firstly_shared`` / ``is_distributed`` marks and all-reduces over the
sharding, mp and pp groups, but sums float16, bfloat16 and float32 grads only: on HSDP
shards it is replaced by this clip, which counts every dtype.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Sequence, TypeVar

import paddle
import paddle.nn.utils as utils
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (  # noqa: E501
    HybridParallelClipGrad,
)
from paddle.nn import ClipGradByGlobalNorm

from ..comm import collectives as comm
from ..comm import watchdog
from ..engine import offload
from ..engine.optimizers import (managed_shards, sharded_params_of, units_of_shards,
                                 unwrap_optimizer)
from ..engine.registry import managed_param
from ..engine.reductions import sync_grads
from ..hints import expect_optimizer
from .patching import replace

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.nn.clip import ClipGradBase

    from ..engine.buffer import ShardBuffer
    from ..topology.mesh import Mesh

    # a parameter and its grad, as a clip sees them
    Pair = tuple[paddle.Tensor, paddle.Tensor]

# the dtype a norm is summed in (norm_dtype)
NormDtype = Literal["float32", "float64"]
R = TypeVar("R")


class HSDPClipGradByGlobalNorm(ClipGradByGlobalNorm):
    """``ClipGradByGlobalNorm`` for HSDP shards; ``last_global_norm`` keeps the norm.

    ``mp_rank`` / ``sep_rank``: this rank's index in the tensor-parallel and sep groups;
    ``group``: the group that spans every distinct shard (None: the whole job).
    ``per_replica``: each outer replica's own norm (DiLoCo's replicas train apart
    between outer syncs: engine/diloco.py): every rank counts its shards, ``group`` is
    the replica's inner group.
    """

    def __init__(self, clip_norm: float, group: Group | None = None, mp_rank: int = 0,
                 sep_rank: int = 0, group_name: str = "default_group",
                 auto_skip_clip: bool = False, fsdp_rank: int = 0,
                 expert_fsdp_rank: int = 0, per_replica: bool = False) -> None:
        super().__init__(clip_norm, group_name, auto_skip_clip)
        self.group = group
        self.per_replica = per_replica
        self.mp_rank = mp_rank
        self.sep_rank = sep_rank
        self.fsdp_rank, self.expert_fsdp_rank = fsdp_rank, expert_fsdp_rank
        self.last_global_norm: paddle.Tensor | None = None

    def counts(self, param: paddle.Tensor) -> bool:
        """Whether this rank's copy of ``param`` is the one the norm counts."""
        if getattr(param, "is_firstly_shared", True) is False and not (
                self.per_replica and hasattr(param, "_hsdp_sharded_param")):
            return False
        if not hasattr(param, "_hsdp_sharded_param"):
            # Not an HSDP shard (ignored_params): a copy on every FSDP rank, which the
            # user keeps in sync; count it on FSDP rank 0 only.
            expert = getattr(param, "is_moe_param", False) or getattr(param, "expert", False)
            if (self.expert_fsdp_rank if expert else self.fsdp_rank) != 0:
                return False
        if self.sep_rank != 0:
            return False
        return self.mp_rank == 0 or bool(getattr(param, "is_distributed", False))

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads: list[tuple[paddle.Tensor, paddle.Tensor | None]],
                      ) -> list[tuple[paddle.Tensor, paddle.Tensor | None]]:
        dtype = norm_dtype(g for _, g in params_grads)
        clipped = [(p, g) for p, g in params_grads
                   if g is not None and getattr(p, "need_clip", True) is not False]
        counted = [(p, g) for p, g in clipped if self.counts(p)]
        sum_sq = _local_sum(counted, dtype, lambda t: paddle.sum(paddle.square(t)))
        group = self.group or paddle.distributed.collective._get_global_group()
        with offload.on_device():  # offloaded grads: the norm still travels on the device
            comm.all_reduce(sum_sq, group, tag="clip")
            norm = paddle.sqrt(sum_sq)
        self.last_global_norm = norm
        if self.auto_skip_clip:
            with watchdog.host_sync("the clip's read of the global grad norm"):
                small = float(norm) <= self.clip_norm
            if small:
                return params_grads
        with offload.on_device():
            max_norm = paddle.full([1], self.clip_norm, dtype=dtype)
            scale = max_norm / paddle.maximum(norm, max_norm)
        # In place, as Paddle 3.3's clip scales a grad (a 0-D one excepted, as there),
        # so grads carried into the next step (no clear_grad) are the clipped ones.
        _scale_grads([(p, g) for p, g in clipped if g.shape], scale)
        new = {id(p): g * scale.astype(g.dtype).reshape([]) for p, g in clipped
               if not g.shape}
        return [(p, new.get(id(p), g)) for p, g in params_grads]


def _storage_of(param: paddle.Tensor, grad: paddle.Tensor,
                ) -> tuple[paddle.Tensor, ShardBuffer] | None:
    """The buffer's flat grad (or main-grad) storage ``grad`` is ``param``'s view of,
    and that buffer; None for any other grad."""
    sp = getattr(param, "_hsdp_sharded_param", None)
    buf = getattr(sp, "buffer", None)
    if sp is None or buf is None:
        return None
    for flat in buf.grads.flats():
        if flat is not None and flat.dtype == grad.dtype and sp.views(grad, flat):
            return flat, buf
    return None


def _by_storage(pairs: Iterable[Pair]) -> tuple[list[tuple[paddle.Tensor, list[Pair]]],
                                                list[Pair]]:
    """Split ``(param, grad)`` pairs into whole flat grad buffers, ``[(flat,
    pairs)]``, and the rest: a buffer whose every param is here with its view of the
    flat storage is one tensor for the norm and the scaling (one kernel, not a few
    per parameter). With outer sub-shards that tensor is this rank's piece of the
    storage (the other pieces are no grads of its params), unless the pieces are shared
    ([Note: shared pieces] in engine/buffer/outer_pieces.py: every replica holds the whole
    synced shard, which is then what counts); either way a param's grad starts
    ``sp.offset`` elements into it."""
    groups: dict[int, tuple[paddle.Tensor, ShardBuffer, list[Pair]]] = {}
    rest: list[Pair] = []
    for p, g in pairs:
        storage = _storage_of(p, g)
        if storage is None:
            rest.append((p, g))
        else:
            flat, buf = storage
            groups.setdefault(id(flat), (flat, buf, []))[2].append((p, g))
    whole = []
    for flat, buf, members in groups.values():
        if len({id(p) for p, _ in members}) == len(buf.params) == len(members):
            whole.append((buf.pieces.piece(flat, buf.part) if buf.scatters_outer else flat, members))
        elif buf.shared_pieces:
            # each replica holds the whole synced grad shard: a param's inner block
            # counts, not its piece (scaling the block scales the piece with it)
            rest.extend((p, p._hsdp_sharded_param.inner_block_of(flat)) for p, _ in members)
        else:
            rest.extend(members)
    return whole, rest


def _local_sum(pairs: Iterable[Pair], dtype: NormDtype,
               term: Callable[[paddle.Tensor], paddle.Tensor],
               combine: str | None = None) -> paddle.Tensor:
    """This rank's part of the norm over ``pairs`` (``term`` of each tensor, summed, or
    combined with ``combine``), as a ``[1]`` tensor on the compute device."""
    whole, rest = _by_storage(pairs)
    tensors = [flat for flat, _ in whole] + [g for _, g in rest]
    want = paddle.float64 if dtype == "float64" else paddle.float32
    terms = [offload.to_compute_device(term(t if t.dtype == want else t.astype(want))
                                       .reshape([1]))
             for t in tensors if math.prod(t.shape) > 0]
    with offload.on_device():
        if not terms:
            return paddle.zeros([1], dtype)
        if combine is None:
            return paddle.add_n(terms) if len(terms) > 1 else terms[0]
        return paddle.max(paddle.concat(terms)).reshape([1])


def _scale_grads(pairs: Iterable[Pair], factor: paddle.Tensor) -> None:
    """Every grad of ``pairs`` times ``factor`` (a ``[1]`` tensor), in place (one kernel
    per whole buffer)."""
    factors = {}  # one copy of the factor per place and dtype

    def factor_for(t: paddle.Tensor) -> paddle.Tensor:
        key = (str(t.place), str(t.dtype))
        if key not in factors:
            f = factor if t.place._equals(factor.place) else factor._copy_to(t.place, True)
            factors[key] = f.astype(t.dtype)
        return factors[key]

    whole, rest = _by_storage(pairs)
    for flat, _ in whole:
        flat.multiply_(factor_for(flat))
    for _, g in rest:
        g.multiply_(factor_for(g))


def norm_dtype(grads: Iterable[paddle.Tensor | None]) -> NormDtype:
    """The dtype Paddle's own clipping sums in: float64 when any grad is float64,
    else float32 (low-precision grads are summed in float32)."""
    return "float64" if any(g is not None and g.dtype == paddle.float64
                            for g in grads) else "float32"


def hsdp_clip_for(clip: ClipGradByGlobalNorm, mesh: Mesh,
                  shards: Sequence[paddle.Tensor] = (),
                  apart: bool | None = None) -> HSDPClipGradByGlobalNorm:
    # The norm spans the mesh's ranks: the whole job on the fleet HCG, the mesh's own
    # group for an explicit mesh that covers part of the world; with the replicas
    # training apart (DiLoCo, or set_requires_all_reduce(False) at the step), one
    # replica's (its inner group). ``apart``: that decision, where the caller made it.
    if apart is None:
        apart = _replicas_train_apart(mesh, shards)
    if apart:
        inner = mesh.inner(False)
        return HSDPClipGradByGlobalNorm(clip.clip_norm, inner, mesh.mp_rank(),
                                        mesh.sep_rank(), clip.group_name,
                                        clip.auto_skip_clip, fsdp_rank=inner.rank,
                                        expert_fsdp_rank=inner.rank, per_replica=True)
    group = mesh.clip_group()
    return HSDPClipGradByGlobalNorm(clip.clip_norm, group, mesh.mp_rank(), mesh.sep_rank(),
                                    clip.group_name, clip.auto_skip_clip,
                                    fsdp_rank=mesh.fsdp_group(False).rank,
                                    expert_fsdp_rank=mesh.fsdp_group(True).rank)


def _replicas_train_apart(mesh: Mesh, shards: Sequence[paddle.Tensor],
                          units: Sequence | None = None) -> bool:
    """Whether a unit of ``shards`` skips this step's outer grad sync (DiLoCo's
    ``OuterSyncPolicy(every >= 2)``, or ``set_requires_all_reduce(False)`` at the
    step): the replicas then step on different grads, and each must clip by its own
    norm (one norm for all would be replica 0's, the only one counted), over its inner
    group, which spans the replica only where the clip's whole span is the dense FSDP
    group (no tensor, pipeline or sep parallelism) and no shard is an expert's;
    elsewhere refused, before any update. ``units``: the shards' units, where the
    caller has them (the step boundary does)."""
    if units is None:
        units = units_of_shards(shards)
    apart = [unit for unit in units if not unit.syncs_grads_over_outer]
    if not apart:
        return False
    span = mesh.clip_group() or paddle.distributed.collective._get_global_group()
    experts = any(buf.is_expert for unit in units for buf in unit.buffers)
    if span.nranks != mesh.fsdp_group(False).nranks or experts:
        why = ("OuterSyncPolicy(every >= 2) (fsdp_outer_sync_every)"
               if apart[0].outer_sync is not None else "set_requires_all_reduce(False)")
        raise NotImplementedError(
            f"a grad clip with {why} at the step ({apart[0].label}): the replicas step on "
            "their own grads, so each clips by its own norm, over its inner group, which "
            "spans the replica only without tensor, pipeline or sep parallelism and "
            "experts. Drop the clip, or sync the grads at the step (every=1, "
            "set_requires_all_reduce(True)). Nothing was updated.")
    return True


def make_clip_hsdp_aware(optimizer: paddle.optimizer.Optimizer,
                         params: Sequence[paddle.Tensor],
                         units: Sequence | None = None) -> None:
    """The one place that decides which clip a step over HSDP shards uses: every clip
    the optimizer and the optimizers it wraps keep (``_grad_clip`` of
    ``HybridParallelOptimizer``, ``MixPrecisionOptimizer`` and the optimizer under them,
    and each parameter group's ``grad_clip``) becomes the HSDP clip with the same
    settings; clips that cannot be right on shards are refused, before any update.
    ``units``: ``params``' units, where the caller has them (the step boundary does).
    Whether the replicas train apart is decided once per call, and only when a clip
    needs it (a step without a clip is never refused for it)."""
    mesh = params[0]._hsdp_sharded_param.mesh
    decided: list[bool] = []

    def apart() -> bool:
        if not decided:
            decided.append(_replicas_train_apart(mesh, params, units))
        return decided[0]

    level = optimizer
    while level is not None:
        own = vars(level)
        if "_grad_clip" in own:
            level._grad_clip = _hsdp_aware(own["_grad_clip"], mesh, apart)
        for group in own.get("_param_groups") or []:
            if isinstance(group, dict) and "grad_clip" in group:
                group["grad_clip"] = _hsdp_aware(group["grad_clip"], mesh, apart)
        level = own.get("_inner_opt")


def hsdp_aware_for(clip: ClipGradBase | HybridParallelClipGrad | None,
                   optimizer: paddle.optimizer.Optimizer,
                   ) -> ClipGradBase | HybridParallelClipGrad | None:
    """``clip`` as :func:`make_clip_hsdp_aware` decides it for ``optimizer``'s shards
    (a parameter group's clip that ``Optimizer.step`` copied before the swap)."""
    shards = sharded_params_of(optimizer)
    if not shards:
        return clip
    mesh = shards[0]._hsdp_sharded_param.mesh
    return _hsdp_aware(clip, mesh, lambda: _replicas_train_apart(mesh, shards))


def _hsdp_aware(clip: ClipGradBase | HybridParallelClipGrad | None, mesh: Mesh,
                apart: Callable[[], bool]
                ) -> ClipGradBase | HybridParallelClipGrad | None:
    """``clip`` on HSDP shards; ``apart()``: whether the replicas train apart this step
    (asked only where a clip needs it)."""
    if clip is None:
        return clip
    if isinstance(clip, HSDPClipGradByGlobalNorm):
        # whether the replicas train apart may change from step to step
        # (set_requires_all_reduce): the norm's span follows it
        now_apart = apart()
        return (clip if clip.per_replica == now_apart
                else hsdp_clip_for(clip, mesh, apart=now_apart))
    if isinstance(clip, HybridParallelClipGrad):
        # fleet's clip over the mp / pp / sharding groups: the HSDP clip counts the
        # same marks over the whole job, in every dtype (Paddle's skips float64)
        return _hsdp_aware(clip._clip, mesh, apart)
    if type(clip) is ClipGradByGlobalNorm:
        return hsdp_clip_for(clip, mesh, apart=apart())
    if isinstance(clip, ClipGradByGlobalNorm):
        raise NotImplementedError(
            f"{type(clip).__name__} subclasses ClipGradByGlobalNorm; paddle_hsdp cannot "
            "tell whether its norm is right on shards. Use paddle.nn.ClipGradByGlobalNorm "
            "or paddle_hsdp.HSDPClipGradByGlobalNorm.")
    if isinstance(clip, paddle.nn.ClipGradByNorm):
        raise NotImplementedError(
            "ClipGradByNorm clips each parameter by its own norm, which a shard cannot "
            "know; use paddle.nn.ClipGradByGlobalNorm (or ClipGradByValue) with paddle_hsdp.")
    return clip


def last_global_norm(optimizer: paddle.optimizer.Optimizer) -> float | None:
    """The global grad norm of the optimizer's last clipped step (for logging)."""
    expect_optimizer(optimizer, "last_global_norm")
    norm = getattr(unwrap_optimizer(optimizer)._grad_clip, "last_global_norm", None)
    if norm is None:
        return None
    with watchdog.host_sync("last_global_norm's read of the global grad norm"):
        return norm.item()


# ---------------------------------------------------------------- paddle.nn.utils
def clip_grad_norm_(parameters: paddle.Tensor | Iterable[paddle.Tensor], max_norm: float,
                    norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> paddle.Tensor:
    """``paddle.nn.utils.clip_grad_norm_`` for HSDP shards (installed in its place).

    Finishes the step's deferred grad sync, then computes the norm over every distinct
    gradient element exactly once (the counting rule of :class:`HSDPClipGradByGlobalNorm`,
    one all-reduce over the job: a sum of ``|g|^p``, or a max for ``inf``), and scales
    the shard grads in place with Paddle's formula. A collective: call it on every rank.
    Parameters that no unit manages keep Paddle's own behaviour.
    """
    if isinstance(parameters, paddle.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    shards = managed_shards(parameters)
    if not shards:
        return _kept_original(_original_clip_grad_norm, "clip_grad_norm_")(
            parameters, max_norm, norm_type, error_if_nonfinite)
    if norm_type not in _NORM_TYPES:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type!r}): supported on HSDP "
                         f"shards are {list(_NORM_TYPES)} (Paddle's order-0 'norm' counts "
                         "whole tensors, which a shard cannot see)")
    sync_grads(units_of_shards(shards))
    params = shards + [p for p in parameters if managed_param(p) is None]
    counter = hsdp_clip_for(ClipGradByGlobalNorm(float(max_norm)),
                            shards[0]._hsdp_sharded_param.mesh, shards)
    total = _global_norm([p for p in params if p.grad is not None], float(norm_type),
                         counter)
    if error_if_nonfinite and not bool(paddle.isfinite(total)):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the "
                           "gradients is non-finite, so it cannot be clipped; pass "
                           "error_if_nonfinite=False to scale by it anyway.")
    coef = paddle.clip(float(max_norm) / (total + 1e-6), max=1.0).reshape([1])
    with paddle.no_grad():
        _scale_grads([(p, p.grad) for p in params if p.grad is not None], coef)
    return total


_NORM_TYPES = (float("inf"), 1, 2)


@paddle.no_grad()
def _global_norm(params: Sequence[paddle.Tensor], norm_type: float,
                 counter: HSDPClipGradByGlobalNorm) -> paddle.Tensor:
    """The norm over the job of the counted copies' grads (one all-reduce)."""
    infinite = norm_type == float("inf")
    dtype = norm_dtype(p.grad for p in params)
    counted = [(p, g) for p in params if (g := p.grad) is not None and counter.counts(p)]
    if infinite:
        local = _local_sum(counted, dtype, lambda t: t.abs().max(), combine="max")
    else:
        local = _local_sum(counted, dtype, lambda t: (t.abs() ** norm_type).sum())
    group = counter.group or paddle.distributed.collective._get_global_group()
    with offload.on_device():
        comm.all_reduce(local, group, tag="clip", op="max" if infinite else "sum")
        if infinite:
            return local.reshape([])
        return (local ** (1.0 / norm_type)).reshape([])


def clip_grad_value_(parameters: paddle.Tensor | Iterable[paddle.Tensor],
                     clip_value: float) -> None:
    """``paddle.nn.utils.clip_grad_value_`` for HSDP shards: finishes the deferred
    grad sync first, so the clipped values are the step's synced grads."""
    if isinstance(parameters, paddle.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    shards = managed_shards(parameters)
    sync_grads(units_of_shards(shards))
    rest = [p for p in parameters if managed_param(p) is None]
    _kept_original(_original_clip_grad_value, "clip_grad_value_")(shards + rest, clip_value)


# Paddle's own, once install() has put these in their place
_original_clip_grad_norm: Callable[..., paddle.Tensor] | None = None
_original_clip_grad_value: Callable[..., None] | None = None


def _kept_original(original: Callable[..., R] | None, name: str) -> Callable[..., R]:
    if original is None:
        raise RuntimeError(f"paddle_hsdp.patches.clip.{name} ran before install() kept "
                           f"Paddle's paddle.nn.utils.{name}")
    return original


def install() -> None:
    """Put the HSDP-aware versions where ``paddle.nn.utils`` users find them."""
    global _original_clip_grad_norm, _original_clip_grad_value
    if _original_clip_grad_norm is not None:
        return
    _original_clip_grad_norm, _original_clip_grad_value = (utils.clip_grad_norm_,
                                                           utils.clip_grad_value_)
    why = {"clip_grad_norm_": "the norm over every distinct element of HSDP shards, once",
           "clip_grad_value_": "finish the deferred grad sync before clipping"}
    for name, fn in (("clip_grad_norm_", clip_grad_norm_), ("clip_grad_value_", clip_grad_value_)):
        replace(utils, name, fn, why[name])
        module = sys.modules.get(f"paddle.nn.utils.{name}")
        if module is not None and hasattr(module, name):
            replace(module, name, fn, why[name])
