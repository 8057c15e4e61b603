"""What a user is told about a wrong argument, said one way everywhere: the "did you
mean" for unknown names (config keys, fleet's ``sharding_configs`` keys), and the
``TypeError`` for the wrong kind of object (an optimizer where a model is expected, and
the reverse), raised before anything changes instead of an ``AttributeError`` from
Paddle's depths."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

import paddle


def expect_layer(value: Any, call: str) -> None:
    """``TypeError`` unless ``value`` is a ``paddle.nn.Layer`` (``call`` names the API)."""
    if not isinstance(value, paddle.nn.Layer):
        raise TypeError(f"{call} expects a paddle.nn.Layer, got {type(value).__name__}")


def expect_optimizer(value: Any, call: str) -> None:
    """``TypeError`` unless ``value`` is a Paddle optimizer or a wrapper of one (fleet's
    ``distributed_optimizer``, anything with ``_inner_opt``)."""
    inner = value
    while hasattr(inner, "_inner_opt"):
        inner = inner._inner_opt
    if not isinstance(inner, paddle.optimizer.Optimizer):
        raise TypeError(f"{call} expects a paddle.optimizer.Optimizer (or fleet's wrapper "
                        f"of one), got {type(value).__name__}")


def did_you_mean(name: Any, valid: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the valid name closest to ``name``, else ``"."``."""
    if not isinstance(name, str):
        return "."
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else "."
