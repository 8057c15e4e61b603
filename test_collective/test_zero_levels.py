"""ZeRO-1/2/3, the torch accumulation toggles and prefetch on real CPU ranks (HSDP 2x2):
parity with single-process training (float64, workers/parity.py's bound), comm calls per step, held bytes."""

def test_zero_levels_toggles_and_prefetch(hsdp_2x2_log):
    log = hsdp_2x2_log  # workers/worker_zero.py, in the shared 2 x 2 launch (conftest.py)
    for tag, n in (("ZERO stage", 3), ("TOGGLE", 2), ("PREFETCH", 2)):
        assert log.count(tag) == n, log[-3000:]
