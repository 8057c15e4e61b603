"""Fault-tolerant HSDP: replica groups that outlive each other (docs/fault-tolerance.md).

Start a coordinator (``python -m paddle_hsdp.ft.coordinator --port P``), then each
replica group as its own ``paddle.distributed.launch`` job; in the training script,
``replica = paddle_hsdp.ft.init()`` after ``fleet.init`` and before ``fully_shard``,
``replica.attach(model, optimizer)``, and ``replica.train_step(fn)`` for each step. A
stopped job resumes from the groups' joint checkpoint with ``replica.load_checkpoint(path)``
between ``attach`` and the first step.
"""

from .replica import Replica, init
from .protocol import FaultToleranceError

__all__ = ["FaultToleranceError", "Replica", "init"]
