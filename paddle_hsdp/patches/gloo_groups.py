"""Gloo sub-group creation: every gloo sub-group rendezvouses on a store of its own.

Patches ``paddle.distributed.collective._new_process_group_impl``: Paddle 3.3's
``ProcessGroupGloo`` rendezvouses on the global TCP store with keys that do not carry
the group id, so sub-groups created one after another read each other's peer addresses
(launches fail or hang). The wrapper gives every gloo sub-group (id != 0, more than one
rank) its own store from :func:`paddle_hsdp.comm.gloo_store.make_group_store`; NCCL and
the global group are untouched. It also registers
:func:`~paddle_hsdp.comm.gloo_store.stop_servers` with ``atexit``.

Patches the collective methods of ``ProcessGroupGloo`` (``all_reduce``, ``alltoall``,
``barrier``, ...): a call made outside paddle_hsdp's communication thread first waits for what it
runs (:func:`paddle_hsdp.comm.collectives.drain_comm_thread`), because Paddle 3.3's gloo
hangs when two threads of a process run collectives at once (see
``comm.collectives._CommThread``). This covers collectives that do not go through
:mod:`paddle_hsdp.comm`: a MoE layer's all-to-all in backward, user code. Before that
thread is started, the cost is one ``None`` test per call.
"""

from __future__ import annotations

import atexit

import functools
import types
from typing import Any, Callable

from paddle.base import core
from paddle.distributed import collective

from ..comm.collectives import drain_comm_thread
from ..comm.gloo_store import make_group_store, stop_servers
from .patching import replace

_original_impl: Callable[..., core.ProcessGroup] | None = None  # Paddle's, once installed


def _safe_new_process_group_impl(backend: str, store: core.Store, rank: int,
                                 world_size: int, group_name: str, pg_options: object,
                                 group_id: int = 0, *args: Any,
                                 **kwargs: Any) -> core.ProcessGroup:
    original = _original_impl
    if original is None:
        raise RuntimeError("paddle_hsdp.patches.gloo_groups: the sub-group wrapper ran "
                           "before install() kept Paddle's _new_process_group_impl")
    if backend == "gloo" and group_id != 0 and world_size > 1:
        store = make_group_store(store, rank, world_size, group_id)
    return original(backend, store, rank, world_size, group_name, pg_options,
                    group_id, *args, **kwargs)


def install() -> None:
    """Route Paddle's sub-group creation through
    :func:`~paddle_hsdp.comm.gloo_store.make_group_store` (idempotent).

    ``paddle.distributed.new_group`` looks ``_new_process_group_impl`` up in its module
    at call time, so replacing the module attribute covers every caller, Paddle's HCG
    included.  The global group (id 0) keeps the global store: it is created first and
    alone, so it cannot collide.
    """
    global _original_impl
    if _original_impl is not None:
        return
    _original_impl = collective._new_process_group_impl
    replace(collective, "_new_process_group_impl", _safe_new_process_group_impl,
            "gloo sub-groups rendezvous on a store of their own, not on colliding global keys")
    # Registered after Paddle's own handlers, so it runs before them (LIFO).
    atexit.register(stop_servers)


# Every method of ProcessGroupGloo that starts communication (Paddle 3.3's names).
_GLOO_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_partial", "all_reduce",
    "all_to_all", "all_to_all_single", "all_to_all_tensor", "allreduce", "alltoall",
    "alltoall_single", "barrier", "broadcast", "gather", "recv", "recv_partial", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_tensor", "send",
    "send_partial")


_serialized = False


def serialize_collectives() -> None:
    """Wrap the collective methods (idempotent; after cpu_compat, whose CPU
    ``all_reduce_on_calc_stream`` calls the wrapped ``all_reduce``)."""
    global _serialized
    if _serialized:
        return
    _serialized = True
    group_class = getattr(core, "ProcessGroupGloo", None)
    if group_class is None:  # a build without gloo
        return
    for name in _GLOO_COLLECTIVES:
        for variant in (name, name + "_on_calc_stream"):
            method = getattr(group_class, variant, None)
            # a Python function is a patch already (cpu_compat's all_reduce_on_calc_stream
            # calls the patched all_reduce)
            if method is not None and not isinstance(method, types.FunctionType):
                replace(group_class, variant, _after_comm_thread(method),
                        "a gloo collective waits for paddle_hsdp's communication thread: two "
                        "at once in one process hang")


def _after_comm_thread(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: core.ProcessGroupGloo, *args: Any, **kwargs: Any) -> Any:
        drain_comm_thread()
        return method(self, *args, **kwargs)
    return run
