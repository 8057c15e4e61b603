"""Muon: momentum orthogonalised by a Newton-Schulz iteration for the weight matrices,
AdamW for the rest (K. Jordan et al. 2024; Moonlight, Kimi K2 and GLM-4.5 trained with
it), with the interface of Paddle's own ``paddle.optimizer.Muon`` (Paddle after 3.3), so
code written for it runs on Paddle 3.3 too.

One step of a matrix parameter ``W`` (2-D; a 3-D stack is a batch of matrices) with
grad ``g``, momentum ``beta``, learning rate ``lr`` and weight decay ``wd``:

* ``m = beta * m + (1 - beta) * g`` (an average, as Paddle's and torch's code keep it),
  ``u = (1 - beta) * g + beta * m`` with Nesterov, else ``u = m``;
* ``O = NS(u)``: ``X = u / max(|u|_F, eps)`` (transposed when it has more rows than
  columns), then ``ns_steps`` times ``A = X X^T; X = a X + (b A + c A A) X`` with the
  coefficients of ``ns_coeff_type``, in ``ns_matmul_dtype``;
* ``W = W (1 - lr wd)`` (decoupled, where ``apply_decay_param_fun`` allows), then
  ``W = W - lr * scale * O`` with ``scale = muon_extra_scale_factor *`` ``max(1,
  out/in) ** 0.5`` (``muon_version=1``; Paddle's layout is ``[in, out]``), ``(out/in)
  ** 0.5`` (2) or ``max(in, out) ** 0.5`` (3: Moonlight's "match AdamW RMS" with the
  default 0.2).

Every other parameter (and every matrix ``muon_param_info_map`` or
``muon_exclude_patterns`` leaves out: embeddings, the output head, biases, MoE gates by
default) takes Paddle's AdamW kernel with ``adam_beta1``, ``adam_beta2``,
``adam_epsilon`` and the same ``weight_decay``. Grad clipping (``grad_clip``) runs over
both, before the split, as Paddle's does.

Under HSDP each matrix must be whole on the rank that updates it: shard with
``shard_placement_fn=paddle_hsdp.owned_matrices()`` (its owner holds all of it, the
others a 0-row shard, skipped here), or keep it whole everywhere with ``Replicate()``;
a matrix cut into rows is refused at the step (``needs_whole_matrices``). Where outer
replicas each hold the same matrix whole (owners kept in the inner group), the engine
gives each matrix to one replica (``orthogonalise_over_replicas``): only it runs the
iteration, and one all-gather per outer group and dtype at the step's end brings the
results to the others (the step's transient memory: the rank's matrices' results in
one buffer), so each matrix is orthogonalised once per job; that replica alone keeps
its momentum (``keep_momentum_on_owners``: the others never read it) and alone
receives its reduced grad, packed over the model with the other matrices' in one
reduce-scatter (engine/owned_exchange.py; the others' copy of the grad is zero), so
the bytes across machines are plain HSDP's. ``outer_exchange="spread"`` instead lays
each buffer's owners over inner x outer at the first step (the layout of before
2026-12-07; each buffer padded to its heaviest segment).

Tensor parallelism: a matrix Paddle's mp layers split (``is_distributed``, with its
``split_axis``) is one slice of the logical matrix per mp rank. ``tp_mode="duplicated"``
(the default) joins the slices' updates over the mp group and orthogonalises and
scales the whole matrix once: the update of one process holding the whole matrix. The
step's split matrices are spread over the mp ranks (by Newton-Schulz work); each rank
gathers the slices of its matrices, orthogonalises them and scatters the results'
slices back, at the step's end (two collectives per mp rank a step, whatever the
number of matrices; each matrix's iteration run once, not mp times). ``tp_mode="blockwise"`` orthogonalises each slice apart, scaled by
its own shape, with no communication (Megatron-LM's ``--muon-tp-mode blockwise``): a
different optimizer, chosen knowingly. Under HSDP the owners of one matrix's slices are
one mp group (the layouts of the mp ranks match, which the engine checks once).

Deviations from Paddle's, where its behaviour would fail: a parameter missing from
``muon_param_info_map`` falls back to the default rule instead of failing an assertion,
``muon_exclude_patterns=None`` means :data:`MUON_EXCLUDE` (Paddle raises), and
``ns_matmul_dtype=None`` runs the iteration in the momentum's dtype unless a GPU of
compute capability 8 or more is used (bfloat16 there, as Paddle).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import _C_ops

from ..comm import collectives as comm
from ..topology.placement import ModelAxes, split_axis

#: The name fragments Muon leaves to AdamW by default: PaddleFormers' list, with the MoE
#: gate as "mlp.gate." (PaddleFormers' "mlp.gate" also matches every dense FFN's
#: "mlp.gate_proj", which Muon should update).
MUON_EXCLUDE = ("embed", "bias", "lm_head", "mlp.gate.")

#: How a tensor-parallel matrix is orthogonalised (see the module docstring).
TP_MODES = ("duplicated", "blockwise")

#: How the owners of a matrix reach the outer replicas under plain HSDP (issue 65):
#: "packed" keeps them in the inner group and exchanges the shared matrices' grads
#: packed over the model (engine/owned_exchange.py); "spread" lays each buffer's owners
#: over inner x outer (the layout of before 2026-12-07: each buffer padded to its
#: heaviest segment).
OUTER_EXCHANGES = ("packed", "spread")

#: Newton-Schulz coefficients ``(a, b, c)`` per iteration (cycled), by name, as Paddle's.
NS_COEFFICIENTS: dict[str, list[tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)],
}


def newton_schulz_flops(shape: Sequence[int], steps: int) -> int:
    """Multiply-add flops (2 per product term) of ``steps`` Newton-Schulz iterations on
    matrices of ``shape`` (``[m, n]`` with ``m <= n``, or a batch ``[b, m, n]``): per
    iteration ``X X^T`` (m x n x m), ``A A`` (m x m x m) and ``B X`` (m x m x n)."""
    *batch, m, n = shape
    count = math.prod(batch) if batch else 1
    return count * steps * 2 * (2 * m * m * n + m * m * m)


@dataclass
class MuonParamInfo:
    """Per parameter (by ``param.name``): whether Muon updates it, and optionally how
    its matrix is split into the matrices orthogonalised apart (a fused QKV) and joined
    again: ``split_concat_func(u, ortho)``."""

    use_muon: bool = True
    split_concat_func: Callable[[paddle.Tensor, Callable], paddle.Tensor] | None = None


def muon_param_info(model: paddle.nn.Layer,
                    exclude_patterns: Sequence[str] = MUON_EXCLUDE) -> dict[str, MuonParamInfo]:
    """``{param.name: MuonParamInfo}`` for ``model``: Muon for a 2-D or 3-D parameter
    whose structured name (``model.named_parameters()``) and ``param.name`` both pass
    ``exclude_patterns``. Give it to ``Muon(muon_param_info_map=...)`` and
    ``paddle_hsdp.owned_matrices(info=...)`` alike, so the matrices Muon updates are
    the ones kept whole (PaddleFormers builds its map from structured names too)."""
    return {p.name: MuonParamInfo(use_muon=all(
        default_should_use_muon(label, p.shape, exclude_patterns) for label in (name, p.name)))
        for name, p in model.named_parameters()}


def default_should_use_muon(name: str, shape: Sequence[int],
                            exclude_patterns: Sequence[str] | None = MUON_EXCLUDE) -> bool:
    """Paddle's rule: a 2-D matrix or 3-D stack of them whose name contains none of
    ``exclude_patterns`` (case-insensitive)."""
    if len(shape) not in (2, 3):
        return False
    lowered = name.lower()
    return not any(p.lower() in lowered for p in (exclude_patterns or ()))


def _ns_matmul_dtype(given: str | paddle.dtype | None) -> paddle.dtype | None:
    if isinstance(given, str):
        # (Paddle's stubs say VarType or DataType; in eager mode it is a paddle.dtype)
        return paddle.base.framework.convert_np_dtype_to_dtype_(given)  # type: ignore[return-value]
    if given is not None:
        return given
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        major, _ = paddle.device.cuda.get_device_capability()
        if major >= 8:
            return paddle.bfloat16
    return None


class Muon(paddle.optimizer.Optimizer):
    """See the module docstring; the arguments are Paddle's (``paddle.optimizer.Muon``)."""

    #: engine/optimizers.py: each matrix must be whole where it is updated
    needs_whole_matrices = True
    #: engine/optimizers.py: a tensor-parallel slice is joined (or, blockwise, updated
    #: apart by choice), so is_distributed matrices are not refused
    handles_tensor_parallel_slices = True

    def __init__(self, learning_rate: float | paddle.optimizer.lr.LRScheduler = 0.02,
                 parameters: Sequence[paddle.Tensor] | None = None, momentum: float = 0.95,
                 adam_beta1: float = 0.9, adam_beta2: float = 0.95,
                 weight_decay: float = 0.01, ns_steps: int = 5,
                 ns_coeff_type: str = "simple",
                 ns_coeffs: Sequence[tuple[float, float, float]] | None = None,
                 nesterov: bool = True, adam_epsilon: float = 1e-9,
                 grad_clip: paddle.nn.ClipGradByGlobalNorm | None = None,
                 lr_ratio: Callable[[paddle.Tensor], float] | None = None,
                 apply_decay_param_fun: Callable[[str], bool] | None = None,
                 muon_version: int = 1, muon_exclude_patterns: Sequence[str] | None = None,
                 muon_extra_scale_factor: float = 0.2,
                 muon_param_info_map: dict[str, MuonParamInfo] | None = None,
                 ns_matmul_dtype: str | paddle.dtype | None = None,
                 multi_precision: bool = False, name: str | None = None,
                 tp_mode: str = "duplicated", share_over_replicas: bool = True,
                 outer_exchange: str = "packed", **kwargs: Any):
        if parameters is None:
            raise ValueError("Muon(parameters=...): pass the parameters to update "
                             "(model.parameters())")
        parameters = list(parameters)
        if any(isinstance(p, dict) for p in parameters):
            raise TypeError("Muon(parameters=...): parameter groups (dicts) are not "
                            "supported, as in Paddle's Muon; pass a list of parameters")
        if ns_coeff_type == "custom":
            if not ns_coeffs:
                raise ValueError("Muon(ns_coeff_type='custom') needs ns_coeffs=[(a, b, c), ...]")
            if any(len(c) != 3 for c in ns_coeffs):
                raise ValueError("Muon(ns_coeffs=...): (a, b, c) triples, got "
                                 f"{list(ns_coeffs)!r}")
            coeffs = [(float(a), float(b), float(c)) for a, b, c in ns_coeffs]
        elif ns_coeff_type in NS_COEFFICIENTS:
            coeffs = NS_COEFFICIENTS[ns_coeff_type]
        else:
            raise ValueError(f"Muon(ns_coeff_type=...): one of "
                             f"{sorted(NS_COEFFICIENTS) + ['custom']}, got {ns_coeff_type!r}")
        if muon_version not in (1, 2, 3):
            raise ValueError(f"Muon(muon_version=...): 1, 2 or 3, got {muon_version!r}")
        if not isinstance(share_over_replicas, bool):
            raise TypeError("Muon(share_over_replicas=...) must be True or False, got "
                            f"{share_over_replicas!r}")
        if outer_exchange not in OUTER_EXCHANGES:
            raise ValueError(f"Muon(outer_exchange=...): one of {list(OUTER_EXCHANGES)}, "
                             f"got {outer_exchange!r}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"Muon(tp_mode=...): one of {list(TP_MODES)}, got {tp_mode!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon(momentum=...): in [0, 1), got {momentum!r}")
        super().__init__(learning_rate=learning_rate, parameters=parameters,
                         weight_decay=None, grad_clip=grad_clip, name=name)
        self.type = "muon"
        self._momentum, self._nesterov = float(momentum), bool(nesterov)
        self._beta1, self._beta2 = float(adam_beta1), float(adam_beta2)
        self._epsilon, self._weight_decay = float(adam_epsilon), float(weight_decay)
        self._ns_steps, self._ns_coeffs = int(ns_steps), coeffs
        # Newton-Schulz work this rank did (newton_schulz_flops), for benchmarks
        self.ns_flops = 0
        self._lr_ratio, self._apply_decay_param_fun = lr_ratio, apply_decay_param_fun
        self._muon_version, self._extra_scale = muon_version, float(muon_extra_scale_factor)
        self._exclude = tuple(MUON_EXCLUDE if muon_exclude_patterns is None
                              else muon_exclude_patterns)
        self._info = dict(muon_param_info_map or {})
        self._ns_dtype = _ns_matmul_dtype(ns_matmul_dtype)
        self._multi_precision = bool(multi_precision)
        self._tp_mode = tp_mode
        # tensor-parallel slices whose update waits for the step's end (_finish_update)
        self._joined: list[_Joined] = []
        # issue 65: {param.name: (outer group, replica)}: matrices whole and equal on
        # every replica, orthogonalised by that replica alone (the engine says which)
        self._replica_shares: dict[str, tuple[Any, int]] = {}
        # False: each replica repeats the iteration rather than send its results across
        # machines (the all-gather's bytes: a slow outer link, small matrices)
        self._share_over_replicas = share_over_replicas
        self._outer_exchange = outer_exchange
        # {param.name: (outer group, replica)}: the one replica keeping each shared
        # matrix's momentum (fixed once the layouts are; the others hold none)
        self._momentum_owners: dict[str, tuple[Any, int]] = {}
        self._shared: list[_Shared] = []
        self._master_weights: dict = {}
        self._already_create_accumulator: set = set()

    @property
    def joins_tensor_parallel_slices(self) -> bool:
        """engine/optimizers.py: whether the step calls the mp group per split matrix
        (``tp_mode="duplicated"``), so the mp ranks' owners must match."""
        return self._tp_mode == "duplicated"

    @property
    def shares_over_replicas(self) -> bool:
        """engine/optimizers.py: whether the replicas' shared matrices reach their
        replica only (each one's grad exchanged packed, engine/owned_exchange.py)."""
        return self._share_over_replicas and self._outer_exchange == "packed"

    @property
    def spreads_owners_over_replicas(self) -> bool:
        """engine/optimizers.py: whether the first step lays each buffer's owners over
        inner x outer (``outer_exchange="spread"``) rather than keeping them in the inner
        group."""
        return self._outer_exchange == "spread"

    def orthogonalise_over_replicas(self, shares: dict[str, tuple[Any, int]]) -> None:
        """The engine's answer for this step (engine/optimizers.py,
        ``share_orthogonalisation_over_replicas``): ``{param.name: (group, replica)}``
        for matrices every rank of ``group`` holds whole with the same grad; replica
        ``replica`` alone orthogonalises each, and the results are all-gathered over
        ``group`` at the step's end (:meth:`_exchange_over_replicas`). With
        ``Muon(share_over_replicas=False)`` every replica orthogonalises them all."""
        self._replica_shares = dict(shares) if self._share_over_replicas else {}

    def keep_momentum_on_owners(self, owners: dict[str, tuple[Any, int]]) -> None:
        """The engine's choice of :meth:`orthogonalise_over_replicas`' replicas, told
        once, before any state is made: replica ``replica`` of ``group`` alone keeps the
        momentum of each (the others receive its results, so never read it): Muon's
        state per rank is 1/(inner x outer) of the model's, not 1/inner. Not with
        ``share_over_replicas=False`` (every replica steps on its own momentum)."""
        if self._share_over_replicas:
            self._momentum_owners = dict(owners)

    @property
    def momentum_owners(self) -> dict[str, tuple[Any, int]]:
        """``{param.name: (outer group, replica)}``: the one replica keeping each shared
        matrix's momentum (:meth:`keep_momentum_on_owners`; empty when none does)."""
        return dict(self._momentum_owners)

    def momentum_elsewhere(self, param: paddle.Tensor) -> bool:
        """Whether another replica keeps ``param``'s momentum (:meth:`keep_momentum_on_owners`)."""
        owner = self._momentum_owners.get(param.name)
        return owner is not None and owner[0].rank != owner[1]

    def holds_state_alone(self, param: paddle.Tensor, state: str) -> bool:
        """Whether this rank's replica alone keeps ``param``'s ``state`` (its momentum,
        :meth:`keep_momentum_on_owners`; the checkpoint's boxes: the other outer
        replicas hold none of it, engine/holdings.py)."""
        owner = self._momentum_owners.get(param.name)
        return state == "moment1" and owner is not None and owner[0].rank == owner[1]

    # -------------------------------------------------------------- which parameters
    def updates_as_matrix(self, param: paddle.Tensor) -> bool:
        """Whether Muon (not AdamW) updates ``param``: its ``muon_param_info_map`` entry,
        else :func:`default_should_use_muon` on ``param.name`` (Paddle's rule; the same
        sharded or not) and its full shape. For structured names (``lm_head.weight`` is
        ``linear_7.w_0`` to Paddle) build the map with :func:`muon_param_info` and give
        it to ``owned_matrices`` too."""
        info = self._info.get(param.name)
        if info is not None:
            return bool(info.use_muon)
        sharded = getattr(param, "_hsdp_sharded_param", None)  # a shard: its full shape
        shape = sharded.shape if sharded is not None else \
            getattr(param, "original_shape", param.shape)
        return default_should_use_muon(param.name, shape, self._exclude)

    # -------------------------------------------------------------- state
    def _low_precision(self, p: paddle.Tensor) -> bool:
        return self._is_dtype_fp16_or_bf16(p.dtype)

    def refusal(self, parameters: Sequence[paddle.Tensor]) -> str | None:
        """Why Muon cannot update ``parameters`` (tensor-parallel slices it cannot join),
        or None. Raised before any state or update; the engine asks it once over every
        rank of a sharded model (engine/optimizers.py), so a pipeline stage that has
        such a slice does not stop alone."""
        joined = [p for p in parameters if self._tp_mode == "duplicated" and
                  getattr(p, "is_distributed", False) and self.updates_as_matrix(p)]
        unplaced = [p.name for p in joined if getattr(p, "split_axis", None) is None]
        if unplaced:
            return (f"Muon: {unplaced[:3]} are split by tensor parallelism (is_distributed) "
                    "without a split_axis, so which slice of the matrix each rank holds is "
                    "unknown and the slices cannot be joined. Give them split_axis (as "
                    "Paddle's mp layers do), use tp_mode='blockwise' or leave them to "
                    "AdamW. Nothing was updated.")
        fused = [p.name for p in joined
                 if self._info.get(p.name, MuonParamInfo()).split_concat_func is not None]
        if fused:
            return (f"Muon: {fused[:3]} are split by tensor parallelism and have a "
                    "split_concat_func: the function cuts the logical matrix, while the "
                    "joined mp slices are laid out slice after slice (a fused weight's "
                    "slices interleave its parts). Use tp_mode='blockwise' with a "
                    "function that cuts one rank's slice, or leave them to AdamW. Nothing "
                    "was updated.")
        return None

    def _create_accumulators(self, block: Any, parameters: Sequence[paddle.Tensor]) -> None:
        why = self.refusal(parameters)
        if why is not None:  # before any state or update
            raise NotImplementedError(why)
        for p in parameters:
            if p.name in self._already_create_accumulator:
                continue
            target = p
            if self._multi_precision and self._low_precision(p):
                target = self._create_master_weight(p)
            dtype = paddle.float32 if self._low_precision(target) else target.dtype
            if not self.momentum_elsewhere(p):
                self._add_accumulator("moment1", target, dtype=dtype)
            if not self.updates_as_matrix(p):
                self._add_accumulator("moment2", target, dtype=dtype)
                for acc, beta in (("beta1_pow_acc", self._beta1), ("beta2_pow_acc", self._beta2)):
                    self._add_accumulator(acc, target, dtype=dtype, fill_value=beta,
                                          shape=[1], device="cpu")
            self._already_create_accumulator.add(p.name)

    # -------------------------------------------------------------- the update
    def _append_optimize_op(self, block: Any, param_and_grad: tuple) -> None:
        param, grad = param_and_grad
        lr = self._create_param_lr(param_and_grad)
        with_decay = self._apply_decay_param_fun is None or \
            self._apply_decay_param_fun(param.name)
        master = self._master_weights.get(param.name) if (
            self._multi_precision and self._low_precision(param)) else None
        if self.updates_as_matrix(param):
            self._muon_update(param, grad, lr, with_decay, master)
        else:
            self._adamw_update(param, grad, lr, with_decay, master)

    def _adamw_update(self, param: paddle.Tensor, grad: paddle.Tensor, lr: paddle.Tensor,
                      with_decay: bool, master: paddle.Tensor | None) -> None:
        acc = self._get_accumulator_master
        ratio = 1.0 if self._lr_ratio is None else self._lr_ratio(param)
        # (the stubs type every tensor input as required; the kernel takes None for the
        # amsgrad moment, the master weight and found_inf, as Paddle's AdamW passes them)
        _C_ops.adamw_(param, grad, lr, acc("moment1", param), acc("moment2", param),
                      None,  # type: ignore[arg-type]
                      acc("beta1_pow_acc", param), acc("beta2_pow_acc", param),
                      master,  # type: ignore[arg-type]
                      None,  # type: ignore[arg-type]
                      self._beta1, self._beta2, self._epsilon, ratio, self._weight_decay,
                      with_decay, False, 1000, master is not None, False, False)

    def _muon_update(self, param: paddle.Tensor, grad: paddle.Tensor, lr: paddle.Tensor,
                     with_decay: bool, master: paddle.Tensor | None) -> None:
        if math.prod(param.shape) == 0:  # an HSDP shard of a matrix another rank owns
            return
        if self.momentum_elsewhere(param):  # the owning replica sends its result
            share = self._replica_shares.get(param.name)
            if share is None:  # (the engine refuses such a step before it starts)
                raise RuntimeError(f"Muon: '{param.name}' keeps its momentum on another "
                                   "replica, and this step does not share it")
            self._shared.append(_Shared(param, None, list(param.shape), *share, lr,
                                        with_decay, master))
            return
        momentum = self._get_accumulator_master("moment1", param)
        beta = self._momentum
        g = grad.astype(momentum.dtype) if grad.dtype != momentum.dtype else grad
        paddle.assign(paddle.lerp(momentum, g, 1.0 - beta), output=momentum)
        update = paddle.lerp(g, momentum, beta) if self._nesterov else momentum
        sharded = getattr(param, "_hsdp_sharded_param", None)
        shape = list(getattr(param, "original_shape", param.shape)) if sharded is None \
            else list(param.shape)
        axis = split_axis(param) if self._tp_mode == "duplicated" else None
        if axis is not None and ModelAxes().mp_degree > 1:  # joined with the other slices
            self._joined.append(_Joined(param, update.reshape(shape), axis, lr, with_decay,
                                        master))
            return
        share = self._replica_shares.get(param.name)
        if share is not None:  # one replica orthogonalises it (_exchange_over_replicas)
            self._shared.append(_Shared(param, update.reshape(shape), shape, *share, lr,
                                        with_decay, master))
            return
        self._apply(param, self._orthogonalize(update.reshape(shape), param.name), lr,
                    with_decay, master)

    def _apply(self, param: paddle.Tensor, ortho: paddle.Tensor, lr: paddle.Tensor,
               with_decay: bool, master: paddle.Tensor | None) -> None:
        """Decay and step ``param`` (its master weight, if any) by the scaled ``ortho``."""
        target = master if master is not None else param
        if with_decay and self._weight_decay > 0:
            target.multiply_((1.0 - lr * self._weight_decay).astype(target.dtype))
        step = ortho.astype(target.dtype) * lr.astype(target.dtype)
        target.subtract_(step.reshape(target.shape))
        if master is not None:
            paddle.assign(master.astype(param.dtype), output=param)

    def _scale(self, shape: Sequence[int]) -> float:
        rows, cols = shape[-2], shape[-1]  # Paddle's weights are [in, out]
        if self._muon_version == 1:
            scale = max(1.0, cols / rows) ** 0.5
        elif self._muon_version == 2:
            scale = (cols / rows) ** 0.5
        else:
            scale = max(rows, cols) ** 0.5
        return self._extra_scale * scale

    def _finish_update(self, block: Any, parameters_and_grads: Any) -> None:
        """The step's tensor-parallel slices (``tp_mode="duplicated"``), all at once:
        :meth:`_orthogonalize_joined`, then each one's decay and step; then the matrices
        shared over the replicas (:meth:`_exchange_over_replicas`)."""
        joined, self._joined = self._joined, []
        if joined:
            for entry, ortho in zip(joined, self._orthogonalize_joined(joined), strict=True):
                self._apply(entry.param, ortho, entry.lr, entry.with_decay, entry.master)
        shared, self._shared = self._shared, []
        buckets: dict[tuple[int, str], list[_Shared]] = {}
        for one in shared:  # one all-gather per outer group and dtype
            buckets.setdefault((one.group.id, str(one.target.dtype)), []).append(one)
        for key in sorted(buckets):
            self._exchange_over_replicas(buckets[key])

    def _exchange_over_replicas(self, entries: list[_Shared]) -> None:
        """Issue 65: each replica orthogonalises its share of ``entries`` (matrices
        whole and equal on every rank of one outer group, one dtype), the results, cast
        to the dtype they step, are all-gathered over the group (each replica's share
        padded to the largest), and every rank steps every matrix by the same bits."""
        group = entries[0].group
        n, me, dtype = group.nranks, group.rank, entries[0].target.dtype
        sizes = [sum(math.prod(e.shape) for e in entries if e.replica == r)
                 for r in range(n)]
        width = max(sizes)
        if width == 0:
            return
        # (this replica's own: it keeps their momentum, so their update is here)
        mine = [self._orthogonalize(e.update, e.param.name).astype(dtype).reshape([-1])
                for e in entries if e.replica == me and e.update is not None]
        send = paddle.concat(mine + [paddle.zeros([width - sizes[me]], dtype=dtype)])
        # offloaded shards (host memory) under NCCL: the all-gather runs on the device
        on_host = send.place.is_cpu_place() and not comm.is_gloo(group)
        if on_host:
            send = send.cuda()
        gathered = paddle.empty([n * width], dtype=dtype)
        if on_host:
            gathered = gathered.cuda()
        comm.all_gather_into(gathered, send, group, what=f"Muon: {len(entries)} matrices "
                             "orthogonalised once over the replicas")
        if on_host:
            gathered = gathered.cpu()
        start = [r * width for r in range(n)]
        for e in entries:
            size = math.prod(e.shape)
            ortho = gathered[start[e.replica]:start[e.replica] + size].reshape(e.shape)
            start[e.replica] += size
            self._apply(e.param, ortho, e.lr, e.with_decay, e.master)

    def _orthogonalize_joined(self, joined: list[_Joined]) -> list[paddle.Tensor]:
        """Each mp-split matrix orthogonalised once over the mp group (issue 65): the
        matrices are spread over the mp ranks (greedy by Newton-Schulz work, alike on
        every rank: every mp rank holds the same matrices' slices here, the engine
        checks the owners match); each owner gathers its matrices' slices, joins them
        as one process holding the whole would, orthogonalises and scales them, and
        scatters the results' slices back. Two collectives per mp rank and dtype a
        step (a gather to it, a scatter from it), whatever the number of matrices;
        this rank's slice of each result, in ``joined``'s order."""
        axes = ModelAxes()
        group, n, me = axes.hcg.get_model_parallel_group(), axes.mp_degree, axes.mp_rank
        owners = spread_matrices([_whole_shape(e) for e in joined], n)
        out: list[paddle.Tensor | None] = [None] * len(joined)
        for dtype in sorted({str(e.update.dtype) for e in joined}):
            for owner in range(n):
                mine = [k for k, e in enumerate(joined)
                        if owners[k] == owner and str(e.update.dtype) == dtype]
                if mine:
                    self._joined_by(owner, [joined[k] for k in mine], group, n, me, out, mine)
        return out  # type: ignore[return-value]

    def _joined_by(self, owner: int, entries: list[_Joined], group: Any, n: int, me: int,
                   out: list, index: list[int]) -> None:
        """``owner``'s share of :meth:`_orthogonalize_joined` (every mp rank calls it)."""
        sizes = [math.prod(e.update.shape) for e in entries]
        send = paddle.concat([e.update.reshape([-1]) for e in entries])
        # offloaded shards (host memory) under NCCL: the collectives and the iteration
        # run on the device (not run here: CPU only)
        on_host = send.place.is_cpu_place() and not comm.is_gloo(group)
        if on_host:
            send = send.cuda()
        what = f"Muon: the mp slices of {len(entries)} matrices for mp rank {owner}"
        slices: list[paddle.Tensor] | None = [] if me == owner else None
        comm.gather(send, slices, dst=group.ranks[owner], group=group, what=what)
        full = None
        if slices is not None:  # this rank orthogonalises them; row j: rank j's slices
            rows: list[list[paddle.Tensor]] = [[] for _ in range(n)]
            start = 0
            for e, size in zip(entries, sizes, strict=True):
                whole = paddle.concat([g[start:start + size].reshape(e.update.shape)
                                       for g in slices], axis=e.axis)
                parts = paddle.split(self._orthogonalize(whole, e.param.name), n, axis=e.axis)
                for j, part in enumerate(parts):
                    rows[j].append(part.reshape([-1]))
                start += size
            full = paddle.concat([paddle.concat(row) for row in rows])
        mine = paddle.empty([sum(sizes)], dtype=send.dtype)
        comm.scatter(mine, full, src=group.ranks[owner], group=group, what=what)
        if on_host:
            mine = mine.cpu()
        start = 0
        for k, e, size in zip(index, entries, sizes, strict=True):
            out[k] = mine[start:start + size].reshape(e.update.shape)
            start += size

    def _orthogonalize(self, update: paddle.Tensor, name: str) -> paddle.Tensor:
        """Newton-Schulz and the shape scale, of the whole matrix or, with a
        ``split_concat_func``, of each piece by its own shape (as Paddle's)."""
        info = self._info.get(name)
        if info is not None and info.split_concat_func is not None:
            return info.split_concat_func(update, self._scaled_newton_schulz)
        return self._scaled_newton_schulz(update)

    def _scaled_newton_schulz(self, update: paddle.Tensor) -> paddle.Tensor:
        return self.newton_schulz(update) * self._scale(list(update.shape))

    def newton_schulz(self, update: paddle.Tensor) -> paddle.Tensor:
        """The orthogonalised ``update`` (2-D, or a batch of matrices in its leading
        dim), in its own dtype."""
        dtype = update.dtype
        tall = update.shape[-2] > update.shape[-1]
        x = update.transpose([0, 2, 1] if update.ndim == 3 else [1, 0]) if tall else update
        flat = x.reshape(list(x.shape[:-2]) + [-1])
        x = F.normalize(flat, p=2, axis=-1, epsilon=self._epsilon).reshape(x.shape)
        if self._ns_dtype is not None and self._ns_dtype != x.dtype:
            x = x.astype(self._ns_dtype)
        swap = [0, 2, 1] if x.ndim == 3 else [1, 0]
        self.ns_flops += newton_schulz_flops(list(x.shape), self._ns_steps)
        for i in range(self._ns_steps):
            a, b, c = self._ns_coeffs[i % len(self._ns_coeffs)]
            gram = paddle.matmul(x, x.transpose(swap))
            x = a * x + paddle.matmul(b * gram + c * paddle.matmul(gram, gram), x)
        if tall:
            x = x.transpose(swap)
        return x.astype(dtype) if x.dtype != dtype else x


@dataclass
class _Joined:
    """A tensor-parallel slice's update waiting for the step's end (``_finish_update``)."""

    param: paddle.Tensor
    update: paddle.Tensor  # this rank's slice of the momentum update
    axis: int  # the axis the mp ranks' slices are joined along
    lr: paddle.Tensor
    with_decay: bool
    master: paddle.Tensor | None


@dataclass
class _Shared:
    """A matrix whose orthogonalisation one outer replica does (``_finish_update``)."""

    param: paddle.Tensor
    # the momentum update, whole (equal on every replica; None where another replica
    # keeps the momentum and orthogonalises it)
    update: paddle.Tensor | None
    shape: list[int]  # the whole matrix's
    group: Any  # the outer group of replicas holding it
    replica: int  # the rank in ``group`` that orthogonalises it
    lr: paddle.Tensor
    with_decay: bool
    master: paddle.Tensor | None

    @property
    def target(self) -> paddle.Tensor:
        """What the step writes (the master weight, if any): the result's dtype."""
        return self.master if self.master is not None else self.param


def _whole_shape(entry: _Joined) -> list[int]:
    shape = list(entry.update.shape)
    shape[entry.axis] *= ModelAxes().mp_degree
    return shape


def spread_matrices(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """Which of ``ranks`` orthogonalises each matrix of ``shapes``: largest Newton-Schulz
    work first, each to the rank with the least so far (the lowest on a tie); the same
    answer on every rank."""
    load = [0] * ranks
    owners = [0] * len(shapes)
    for k in sorted(range(len(shapes)), key=lambda k: (-newton_schulz_flops(
            sorted(shapes[k][-2:]), 1), k)):
        owners[k] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[k]] += newton_schulz_flops(sorted(shapes[k][-2:]), 1)
    return owners
