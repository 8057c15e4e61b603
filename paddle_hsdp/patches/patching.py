"""The one way paddle_hsdp changes Paddle: :func:`replace` sets an attribute of a Paddle
class or module, records what was there before and why, and :func:`active` lists every
patch in force (``paddle_hsdp.patches.active()``), for a reader or a bug report."""

from __future__ import annotations

from dataclasses import dataclass

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """One attribute paddle_hsdp set on a Paddle class or module."""

    owner: object  # the class or module
    name: str
    original: object  # what was there before (None when the attribute is new)
    why: str

    @property
    def target(self) -> str:
        module = getattr(self.owner, "__module__", None)
        qualname = getattr(self.owner, "__qualname__", None)
        if module and qualname:
            return f"{module}.{qualname}.{self.name}"
        return f"{getattr(self.owner, '__name__', self.owner)}.{self.name}"

    @property
    def added(self) -> bool:
        """Whether Paddle had no such attribute before."""
        return self.original is _MISSING


_active: list[Patch] = []


def replace(owner: object, name: str, new: object, why: str) -> object:
    """Set ``owner.name = new`` and record the patch; return what was there before
    (None when there was nothing)."""
    original = getattr(owner, name, _MISSING)
    setattr(owner, name, new)
    _active.append(Patch(owner, name, original, why))
    return None if original is _MISSING else original


def active() -> list[Patch]:
    """Every patch in force, in the order they were made."""
    return list(_active)


def describe() -> str:
    """One line per patch: what it changes and why."""
    return "\n".join(f"{p.target}{' (added)' if p.added else ''}: {p.why}" for p in _active)
