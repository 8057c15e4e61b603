"""Every ``fully_shard`` unit of this process, and which unit owns which parameter.

The bottom of the engine: it imports nothing of the package, so everything above it
(units, hooks, the front end, the Paddle patches, checkpoints) asks it directly instead
of reaching up into :mod:`paddle_hsdp.engine.api`.

One :data:`registry` object per process. Its lists and dicts are never rebound, only
changed in place (hooks keep a reference to ``registry.units``); ``len(registry)`` and
iterating it give the units. A unit's index is its identity (collectives' tags, the
outer-sync order), so it is looked up in :attr:`Registry.by_index`, never by position:
``forget`` (paddle_hsdp.forget) leaves gaps.
"""

from __future__ import annotations


class Registry:
    """The units in registration order (bottom-up: a parent after its children), the
    owner of each original parameter, and the parameters ``fully_shard`` was told to
    ignore."""

    def __init__(self) -> None:
        self.units: list = []  # FSDPUnit, in registration order
        # the index the next unit takes (alike on every rank): indices are the units'
        # identity in collectives' tags and the outer-sync order, and stay with a unit
        # when others are forgotten
        self.next_index = 0
        self.owner_of: dict[int, tuple] = {}  # id(original param) -> (FSDPUnit, ShardedParam)
        # Params some fully_shard call was told to ignore, by id (kept alive so ids
        # stay unique).
        self.ignored: dict = {}
        # Bumped wherever user code may have given a shard (or its grad) new storage:
        # a root forward's start, the optimizer step, clear_grad, a state-dict call.
        # Buffers re-check their views once per value, not on every collective.
        self.storage_epoch = 0

    @property
    def by_index(self) -> dict:
        """``{unit index: unit}`` (built on each call: for lookups off the hot path)."""
        return {unit.index: unit for unit in self.units}

    def add(self, unit) -> None:
        """Register ``unit`` (its index: :attr:`next_index`)."""
        self.units.append(unit)
        self.next_index = unit.index + 1

    def forget(self, units: list, params: list) -> None:
        """Drop ``units`` and what points at them or at ``params`` (their model's)."""
        gone = {id(u) for u in units}
        self.units[:] = [u for u in self.units if id(u) not in gone]
        for key in [k for k, (unit, _) in self.owner_of.items() if id(unit) in gone]:
            del self.owner_of[key]
        for p in params:
            self.ignored.pop(id(p), None)

    def saved(self) -> tuple:
        """What :meth:`restore` puts back (the test suite keeps one process's state
        across tests that each start from an empty registry)."""
        return (list(self.units), dict(self.owner_of), self.next_index)

    def restore(self, saved: tuple) -> None:
        self.clear()
        units, owner_of, self.next_index = saved
        self.units[:] = units
        self.owner_of.update(owner_of)

    def clear(self) -> None:
        """Empty, as in a fresh process (indices start at 0 again)."""
        self.units.clear()
        self.owner_of.clear()
        self.next_index = 0

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

    def module_path(self, module) -> str:
        """``module``'s path from the outermost sharded module that contains it (the
        model root once the root is sharded), as ``named_sublayers`` gives it; "" for
        that module itself. Resolved on each call (error messages only): while only
        blocks are sharded, a block is its own outermost module."""
        for outer in reversed(self.units):
            for name, sub in outer.module.named_sublayers(include_self=True):
                if sub is module:
                    return name
        return ""

    def param_path(self, sp) -> str:
        """The parameter's name as the model's ``named_parameters()`` gives it
        (``layers.0.mlp.gate_proj.weight``), where the model is the outermost sharded
        module: what every refusal and warning names it by (two blocks' parameters
        share their name inside their unit, ``mlp.gate_proj.weight``)."""
        owner = self.owner_of.get(id(getattr(sp, "full", None)))
        prefix = self.module_path(owner[0].module) if owner is not None else ""
        return f"{prefix}.{sp.fqn}" if prefix else sp.fqn

    def buffer_of(self, sp):
        """The buffer of its owning unit that holds ``sp``."""
        unit = self.owning_unit(sp)
        return next(buf for buf in unit.buffers if any(p is sp for p in buf.params))

    def describe_unit(self, unit_index: int) -> str | None:
        """A unit's label, for error messages (None: no such unit here)."""
        unit = self.by_index.get(unit_index)  # (error messages only)
        return unit.label if unit is not None else None

    def describe_buffer(self, unit_index: int, buffer_index: int) -> str | None:
        """What a buffer holds, for error messages (None: no such buffer here)."""
        unit = self.by_index.get(unit_index)  # (error messages only)
        if unit is not None and buffer_index < len(unit.buffers):
            return unit.buffers[buffer_index].describe()
        return None


registry = Registry()
managed_param = registry.managed_param
owning_unit = registry.owning_unit
units_under = registry.units_under
param_path = registry.param_path
