"""Every ``fully_shard`` unit of this process, and which unit owns which parameter.

The bottom of the engine: it imports nothing of the package, so everything above it
(units, hooks, the front end, the Paddle patches, checkpoints) asks it directly instead
of reaching up into :mod:`paddle_hsdp.engine.api`.

One :data:`registry` object per process. Its lists and dicts are never rebound, only
changed in place (hooks keep a reference to ``registry.units``); ``len(registry)`` and
iterating it give the units.
"""

from __future__ import annotations


class Registry:
    """The units in registration order (bottom-up: a parent after its children), the
    owner of each original parameter, and the parameters ``fully_shard`` was told to
    ignore."""

    def __init__(self) -> None:
        self.units: list = []  # FSDPUnit, in registration order
        self.owner_of: dict[int, tuple] = {}  # id(original param) -> (FSDPUnit, ShardedParam)
        # Params some fully_shard call was told to ignore, by id (kept alive so ids
        # stay unique).
        self.ignored: dict = {}
        # Bumped wherever user code may have given a shard (or its grad) new storage:
        # a root forward's start, the optimizer step, clear_grad, a state-dict call.
        # Buffers re-check their views once per value, not on every collective.
        self.storage_epoch = 0

    def storage_may_have_changed(self) -> None:
        self.storage_epoch += 1

    def __len__(self) -> int:
        return len(self.units)

    def __iter__(self):
        return iter(self.units)

    def managed_param(self, value):
        """The :class:`ShardedParam` behind a tensor: a shard param the optimizer sees,
        or an original param (gathered or not) some unit owns; None for anything else."""
        sp = getattr(value, "_hsdp_sharded_param", None)
        if sp is not None:
            return sp
        owner = self.owner_of.get(id(value))
        return owner[1] if owner is not None else None

    def owning_unit(self, sp):
        """The unit that owns the :class:`ShardedParam` ``sp``."""
        return self.owner_of[id(sp.full)][0]

    def units_under(self, model) -> list:
        """The units whose module is ``model`` or one of its sub-layers, in order."""
        subtree = set(id(m) for m in model.sublayers(include_self=True))
        return [u for u in self.units if id(u.module) in subtree]

    def buffer_of(self, sp):
        """The buffer of its owning unit that holds ``sp``."""
        unit = self.owning_unit(sp)
        return next(buf for buf in unit.buffers if any(p is sp for p in buf.params))

    def describe_unit(self, unit_index: int) -> str | None:
        """A unit's label, for error messages (None: no such unit here)."""
        return self.units[unit_index].label if unit_index < len(self.units) else None

    def describe_buffer(self, unit_index: int, buffer_index: int) -> str | None:
        """What a buffer holds, for error messages (None: no such buffer here)."""
        if unit_index < len(self.units) and buffer_index < len(self.units[unit_index].buffers):
            return self.units[unit_index].buffers[buffer_index].describe()
        return None


registry = Registry()
managed_param = registry.managed_param
owning_unit = registry.owning_unit
units_under = registry.units_under
