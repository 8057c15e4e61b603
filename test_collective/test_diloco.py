"""The outer sync every H steps (DiLoCo, ``OuterSyncPolicy(every=4)``) on HSDP 2 x 2
(4 CPU ranks, in the shared 2 x 2 launch), float64: every step's losses and
parameters of each replica against a one-process reference of O replicas with their
own AdamW and the same outer Nesterov step; no outer collective between syncs, the
bytes of a sync from the comm counter; replicas bit-identical after a sync, with and
without ``outer_compress="int8"``; a checkpoint saved mid-interval by 2 x 2 loads in
4 x 1 with the reference's outer anchor, momentum and position
(workers/worker_diloco.py). Plain HSDP with ``set_requires_all_reduce(False)`` at the
step and a clip: each replica clipped by its own norm, as replicas that never sync.
Streaming (``fragments=2``): every step's losses and parameters against the one-process
reference of the same schedule, each sync moving its fragment's bytes only."""


def test_diloco(hsdp_2x2_log):
    log = hsdp_2x2_log  # workers/worker_diloco.py, in the shared 2 x 2 launch
    for line in ("DILOCO parity h4:", "DILOCO no outer collective between syncs",
                 "DILOCO replicas apart after the last sync's interval",
                 "DILOCO checkpoint 2x2 -> 4x1: outer state", "DILOCO clip per replica:",
                 "DILOCO set_requires_all_reduce(False) clips per replica:",
                 "DILOCO streaming f2:",
                 "DILOCO int8 replicas bit-identical after the sync"):
        assert line in log, log[-3000:]
