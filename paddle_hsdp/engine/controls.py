"""What a unit was sharded with and what its module's methods set: two records, so
the unit's own fields are its state, not its settings.

:class:`UnitPolicies` are ``fully_shard``'s arguments, fixed for the unit's life;
:class:`UnitControls` is torch FSDP2's control surface (``set_reshard_after_forward``,
``set_requires_gradient_sync``, prefetch, ...: :class:`~.api.FSDPModule`), read by the
hooks at every forward and backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .policies import MixedPrecisionPolicy, OffloadPolicy, OuterSyncPolicy

if TYPE_CHECKING:
    from .unit import FSDPUnit


@dataclass(frozen=True)
class UnitPolicies:
    mp: MixedPrecisionPolicy | None = None
    offload: OffloadPolicy | None = None  # a plain OffloadPolicy offloads nothing
    # "optim": the optimizer of each outer replica sees 1/O of every trainable buffer
    # (HFSDP; see [Note: outer sub-shards] in engine/param.py)
    outer_sharding: str = "none"
    # every >= 2: the replicas step apart and sync every H steps (DiLoCo: diloco.py)
    outer_sync: OuterSyncPolicy | None = None


@dataclass
class UnitControls:
    reshard_after_forward: bool | None = None  # None: decided at root time
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    is_last_backward: bool = True  # recorded only (torch's hint)
    gradient_divide_factor: float | None = None
    forward_prefetch: list[FSDPUnit] | None = None  # None: the next units in order
    backward_prefetch: list[FSDPUnit] | None = None
    forward_prefetch_count: int = 1
    backward_prefetch_count: int = 1
    # Reduce-scatter when the unit's backward is done (its post-backward), not at the
    # end of the whole backward; False: the end-of-backward reduction.
    reduce_grads_in_backward: bool = True
    # enable_tensor_fusion_and_overlap: collectives asynchronous (prefetch issued
    # early, reductions waited late); False: every collective synchronous.
    overlap: bool = True

