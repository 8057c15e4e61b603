"""Sharded checkpoints that load into another layout: ``save_checkpoint`` /
``load_checkpoint``, and ``python -m paddle_hsdp.checkpoint inspect / consolidate``.

:mod:`.format` (the format, reading checked rows, the ranks' agreement), :mod:`.items`
(what this rank holds), :mod:`.save`, :mod:`.load` and :mod:`.cli` (``inspect``,
``consolidate``). Paddle's ``flex_checkpoint`` sees HSDP shards through
:mod:`paddle_hsdp.engine.flex` (``model.sharded_state_dict()``) and
:mod:`paddle_hsdp.patches.flex_optimizer` (``optimizer.sharded_state_dict(...)``).
"""

from .cli import consolidate, describe, main
from .format import FORMAT, META, CheckpointError, read_metadata
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["FORMAT", "META", "CheckpointError", "consolidate", "describe",
           "load_checkpoint", "main", "read_metadata", "save_checkpoint"]
