"""Sharded checkpoints that load into another layout: ``save_checkpoint`` /
``load_checkpoint``, and ``python -m paddle_hsdp.checkpoint inspect / consolidate``.

:mod:`.format` (the format, reading checked boxes, the ranks' agreement), :mod:`.boxes`
(box arithmetic), :mod:`.items` (what this rank holds, each a box of its full tensor,
from the engine's one statement of it, :func:`paddle_hsdp.engine.holdings.layout_of`:
all a save or load asks of the engine), :mod:`.tp_merge` (models whose
tensor-parallel merge is not a concatenation), :mod:`.save`, :mod:`.load`,
:mod:`.full_model` (every shard, mp slice and stage joined on rank 0: what
``export_pretrained`` writes), :mod:`.cli` (``inspect``, ``consolidate``) and
:mod:`.resume` (a fault-tolerant job resumed from its joint checkpoint). Where a
tensor-parallel slice sits in the full tensor is
:mod:`paddle_hsdp.topology.placement`'s. Paddle's ``flex_checkpoint`` sees HSDP shards
through :mod:`paddle_hsdp.engine.flex` (``model.sharded_state_dict()``) and
:mod:`paddle_hsdp.patches.flex_optimizer` (``optimizer.sharded_state_dict(...)``).
"""

from ..comm.state import state as _comm_state
from .cli import consolidate, describe, main
from .format import FORMAT, META, CheckpointError, read_metadata
from .load import load_checkpoint
from .resume import Resumer
from .save import save_checkpoint

_comm_state.resumer = Resumer()  # what paddle_hsdp.ft resumes a job through

__all__ = ["FORMAT", "META", "CheckpointError", "consolidate", "describe",
           "load_checkpoint", "main", "read_metadata", "save_checkpoint"]
