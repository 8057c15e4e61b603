"""The one "did you mean" for every unknown name a user gives (config keys, fleet's
``sharding_configs`` keys): the closest valid name, or nothing when none is close."""

from __future__ import annotations

import difflib
from typing import Any, Iterable


def did_you_mean(name: Any, valid: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the valid name closest to ``name``, else ``"."``."""
    if not isinstance(name, str):
        return "."
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else "."
