"""ZeRO-1/2/3, the torch accumulation toggles and prefetch on real CPU ranks (HSDP 2x2):
parity with single-process training (float64, workers/parity.py's bound), comm calls per step, held bytes."""

import json

from launcher import launch


def test_zero_levels_toggles_and_prefetch():
    log = launch(4, "worker_zero.py", json.dumps({"sharding_degree": 4, "outer": 2}),
                 timeout=600)
    for tag, n in (("ZERO stage", 3), ("TOGGLE", 2), ("PREFETCH", 2)):
        assert log.count(tag) == n, log[-3000:]
