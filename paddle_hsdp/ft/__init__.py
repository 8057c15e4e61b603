"""Fault-tolerant HSDP: replica groups that outlive each other (docs/fault-tolerance.md).

Start a coordinator (``python -m paddle_hsdp.ft.coordinator --port P``), then each
replica group as its own ``paddle.distributed.launch`` job; in the training script,
``replica = paddle_hsdp.ft.init()`` after ``fleet.init`` and before ``fully_shard``,
``replica.attach(model, optimizer)``, and ``replica.train_step(fn)`` for each step.
"""

from .. import COORDINATOR_ONLY

if not COORDINATOR_ONLY:  # the coordinator's start needs etcd alone, not Paddle
    from .replica import Replica, init
    from .protocol import FaultToleranceError

__all__ = ["FaultToleranceError", "Replica", "init"]
