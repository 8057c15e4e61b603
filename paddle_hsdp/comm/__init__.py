"""Every collective of paddle_hsdp and its safety nets; imports nothing else of the
package.

:mod:`.collectives` (the ops, backend workarounds, the byte counter), :mod:`.gather_tags`
(the tags that catch ranks pairing up different all-gathers), :mod:`.fingerprint` (the
collective fingerprint debug mode), :mod:`.watchdog` (the bound on every wait) and
:mod:`.gloo_store` (a rendezvous store per gloo sub-group).

The collectives' API is also here, as docs/collectives.md shows it (``paddle_hsdp.comm.counter``,
``paddle_hsdp.comm.all_reduce``, ...). To replace one (tests do), patch
:mod:`.collectives`, where the engine looks them up.
"""

from .collectives import (CollectiveError, CommCounter, Handle, HandleLedger, OpStats,
                          UnwaitedCollectiveWarning, all_gather_into, all_reduce, backend_of,
                          barrier, broadcast, counter, group_label, handles, is_gloo,
                          name_group, recv, reduce_scatter, scatter, send, settle)

__all__ = ["CollectiveError", "CommCounter", "Handle", "HandleLedger", "OpStats",
           "UnwaitedCollectiveWarning", "all_gather_into", "all_reduce", "backend_of",
           "barrier", "broadcast", "counter", "group_label", "handles", "is_gloo",
           "name_group", "recv", "reduce_scatter", "scatter", "send", "settle"]
