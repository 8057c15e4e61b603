"""HSDP next to tensor parallelism (mp2) on 8 CPU ranks, with sharding4 as [2 outer, 2
inner]: global clip norm per step, every final parameter and the loss match an
independent single-process reference (float32, workers/parity.py's bound), for the plain
ClipGradByGlobalNorm optimizer and for fleet.distributed_optimizer. It runs in the
8-rank launch (conftest.py: launch_8_log). Pipeline stages run Paddle's own schedule
(``train_batch``) in test_3d.py."""

from launcher import part_of


def test_parity(launch_8_log):  # conftest.py: MP_8
    log = part_of(launch_8_log, "worker_mp_pp.py")
    lines = [line for line in log.splitlines() if "MP_PARITY" in line]
    print("\n".join(lines))
    assert len(lines) == 2, log[-2000:]
