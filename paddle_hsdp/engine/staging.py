"""Staging tensors of the collectives, reused across calls, units and steps.

Every all-gather needs, under mixed precision, a copy of the shard in the gather dtype
and a few elements for its tags, and every reduce-scatter an input (the full grads in
the full buffer's layout: the grad grid autograd adds them to, engine/buffer/full_grads.py,
or their one concatenation) and an output shard. (The all-gather's own
output is not staging: the full parameters are views of it while they are gathered,
engine/buffer/gather.py.) Allocated per call,
each distinct size leaves its own blocks in the allocator (on CPU, glibc keeps freed
blocks below its mmap threshold in the heap; on a device the caching allocator keeps
one pool of blocks per size class), so the high-water mark grows with the number of
distinct buffer shapes. The pool (``context.staging``, :class:`StagingPool`) hands out 1-D tensors and takes them back:

* **Fit.** A request for ``n`` elements of a dtype on a place takes the smallest free
  tensor holding between ``n`` and ``n * FIT`` elements (a view of its first ``n``
  when it is larger), else a new one of exactly ``n``. Units of one shape (the decoder
  layers) share their tensors; the root's buffers (a quarter of a layer's in the
  benchmark's model) borrow a layer's when one is free (when its head and embedding
  reduce), instead of holding tensors of their own through the layers' backward.
* **In flight.** A tensor goes back (:meth:`StagingPool.give`) only after its
  collective's ``wait()`` and after the ops that read it were issued (the tag check of
  an all-gather, the add of a reduced shard). On NCCL that is enough: Paddle's process
  group makes the communication stream wait for the compute stream before every
  collective it issues (``SyncCalcStream``), and ``wait()`` makes the compute stream
  wait for the communication stream, so a collective that reuses a tensor runs after
  the last op that read it, and never while the collective that last wrote it is in
  flight (one reads or writes it until its wait, and it is not given back before).
  An error path never gives a tensor back: the handle keeps it until its wait and the
  allocator gets it after that.
* **Bounded.** The pool holds what was in use at once at its busiest moment (one or
  two reduce-scatter inputs, the tags and casts in flight), the same tensors every
  step. :meth:`StagingPool.release` gives the free ones back to
  the allocator (nothing in flight is touched).

``allocations`` counts the tensors the pool made, so a test can check that a steady
step makes none. Offloaded buffers (``CPUOffloadPolicy``) do not use it: their copies
move between host and device asynchronously on their own terms (engine/offload.py).
"""

from __future__ import annotations

import math

import paddle

FIT = 4.0  # a free tensor of up to FIT x the request serves it (a view of its start)


def _nbytes(t) -> int:
    return math.prod(t.shape) * t.element_size()


class StagingPool:
    """Free 1-D tensors by ``(dtype, place)``, and the ones handed out."""

    def __init__(self) -> None:
        self._free: dict[tuple, list] = {}
        self._out: dict[int, tuple] = {}  # id(handed out) -> (it, its base, free-list key)
        self.allocations = 0  # tensors made since the process started
        self.held_bytes = 0  # every tensor the pool made and has not released
        self.taken_bytes = 0  # of which handed out now
        # of which serving as full grads now (grad grids, engine/buffer/full_grads.py): memory
        # reports count them as full grads, not staging
        self.grad_bytes = 0

    def take(self, numel: int, dtype) -> paddle.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` on the current place,
        uninitialised (the caller writes all of it); give it back when done."""
        key = (str(dtype), str(paddle.get_device()))
        free = self._free.setdefault(key, [])
        best = None  # by position: == on tensors compares elements
        for i, t in enumerate(free):
            size = math.prod(t.shape)
            if numel <= size <= numel * FIT and (
                    best is None or size < math.prod(free[best].shape)):
                best = i
        if best is not None:
            base = free.pop(best)
        else:
            base = paddle.empty([numel], dtype=dtype)
            self.allocations += 1
            self.held_bytes += _nbytes(base)
        t = base if math.prod(base.shape) == numel else base[0:numel]
        self._out[id(t)] = (t, base, key)
        self.taken_bytes += _nbytes(base)
        return t

    @property
    def staging_bytes(self) -> int:
        """What the pool holds, less the grad grids in use (reported as full grads)."""
        return self.held_bytes - self.grad_bytes

    def give(self, t) -> None:
        """Take back a tensor from :meth:`take` (see the module docstring for when)."""
        _, base, key = self._out.pop(id(t))
        self.taken_bytes -= _nbytes(base)
        self._free.setdefault(key, []).append(base)

    def release(self) -> int:
        """Drop every free tensor (handed-out ones stay); return the bytes dropped."""
        dropped = sum(_nbytes(t) for free in self._free.values() for t in free)
        self._free.clear()
        self.held_bytes -= dropped
        return dropped

    def free_count(self) -> int:
        return sum(len(free) for free in self._free.values())

