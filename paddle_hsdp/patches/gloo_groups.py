"""Gloo sub-group creation: every gloo sub-group rendezvouses on a store of its own.

Patches ``paddle.distributed.collective._new_process_group_impl``: Paddle 3.3's
``ProcessGroupGloo`` rendezvouses on the global TCP store with keys that do not carry
the group id, so sub-groups created one after another read each other's peer addresses
(launches fail or hang). The wrapper gives every gloo sub-group (id != 0, more than one
rank) its own store from :func:`paddle_hsdp.comm.gloo_store.make_group_store`; NCCL and
the global group are untouched. It also registers
:func:`~paddle_hsdp.comm.gloo_store.stop_servers` with ``atexit``.
"""

from __future__ import annotations

import atexit

from paddle.distributed import collective

from ..comm.gloo_store import make_group_store, stop_servers
from .patching import replace

_original_impl = None


def _safe_new_process_group_impl(backend, store, rank, world_size, group_name,
                                 pg_options, group_id=0, *args, **kwargs):
    if backend == "gloo" and group_id != 0 and world_size > 1:
        store = make_group_store(store, rank, world_size, group_id)
    return _original_impl(backend, store, rank, world_size, group_name, pg_options,
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
