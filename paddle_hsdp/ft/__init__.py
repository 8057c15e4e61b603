"""Fault-tolerant HSDP: replica groups that outlive each other (docs/fault-tolerance.md).

Start a coordinator (``python -m paddle_hsdp.ft.coordinator --port P``), then each
replica group as its own ``paddle.distributed.launch`` job; in the training script,
``replica = paddle_hsdp.ft.init()`` after ``fleet.init`` and before ``fully_shard``,
``replica.attach(model, optimizer)``, and ``replica.train_step(fn)`` for each step. A
stopped job resumes from the groups' joint checkpoint with ``replica.load_checkpoint(path)``
between ``attach`` and the first step.
"""

import sys

# the coordinator's start (``python -m paddle_hsdp.ft.coordinator``) needs etcd alone, not
# Paddle: the package, imported first, said so (read, not imported: it sits above ft)
if not getattr(sys.modules.get(__name__.rpartition(".")[0]), "COORDINATOR_ONLY", False):
    from .replica import Replica, init
    from .protocol import FaultToleranceError

__all__ = ["FaultToleranceError", "Replica", "init"]
