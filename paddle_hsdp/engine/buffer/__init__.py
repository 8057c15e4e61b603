"""A fused buffer: the parameters of one unit that travel in one collective.

Parameters are grouped by what must agree inside one collective: dtype, trainable or
frozen, dense or expert (expert buffers use the expert groups). Optimizer attributes
need not agree, because the optimizer sees per-parameter shards (see
:mod:`~paddle_hsdp.engine.param`).

The parameters lie in one full flat buffer of ``I * S`` elements and this rank's shard
is its ``S`` of them ([Note: the segment layout] in :mod:`~paddle_hsdp.engine.layout`):
the all-gather's output is the full buffer, every full parameter a view of it, and the
reduce-scatter's input is the full grads in the same layout (autograd adds them there
in place: :mod:`.full_grads`).

With outer sub-shards (``fsdp_outer_sharding="optim"``, HFSDP) the shard is ``Q`` pieces
of ``S / Q`` elements (segments of the layout); outer rank ``q``'s optimizer sees the
rows in piece ``q``. The step's outer all-reduce becomes an outer reduce-scatter of the
grad shard (this rank keeps its piece), and after the update an outer all-gather of the
pieces rebuilds the shard (:mod:`.outer_pieces`), waited before anything reads the
shard again.

:class:`ShardBuffer` (:mod:`.shard_buffer`) is what the buffer is; its parts each own
one piece of its state:

* ``storage`` (:mod:`.storage`): the flat shard the shard params are views of;
* ``grads`` (:mod:`.shard_grads`): the grad shard and its state in the step
  (``GradState``);
* ``full_grads`` (:mod:`.full_grads`): the full-size grads before the reduce-scatter,
  and the early reduction (``EarlyReduce``);
* ``pieces`` (:mod:`.outer_pieces`): the outer sync, HFSDP's pieces and their rebuild
  (``RebuildState``).

The inner all-gather (:mod:`.gather`) and reduce-scatter (:mod:`.inner_reduce`) are
functions of the buffer: what they have in flight is the caller's.
"""

from ...comm import gather_tags
from ..registry import registry
from .shard_buffer import ShardBuffer

# A mismatched all-gather's message names the peer's buffer and the units that ran
# through the registry.
gather_tags.set_buffer_describer(registry.describe_buffer)
gather_tags.set_unit_describer(registry.describe_unit)

__all__ = ["ShardBuffer"]
