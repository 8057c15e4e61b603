"""HSDP next to tensor (mp2) and pipeline (pp2) parallelism on 8 CPU ranks, each with
sharding4 as [2 outer, 2 inner]: global clip norm per step, every final parameter and
the loss match an independent single-process reference (float32, workers/parity.py's bound), for the
plain ClipGradByGlobalNorm optimizer and for fleet.distributed_optimizer. Both layouts
run in the 8-rank launch (conftest.py: launch_8_log), one fleet.init each."""

import pytest

from launcher import part_of


@pytest.mark.parametrize("tag", ["MP", "PP"], ids=["mp2-sharding4-outer2", "pp2-sharding4-outer2"])
def test_parity(tag, launch_8_log):  # conftest.py: MP_PP_CONFIGS
    log = part_of(launch_8_log, "worker_mp_pp.py")
    lines = [line for line in log.splitlines() if f"{tag}_PARITY" in line]
    print("\n".join(lines))
    assert len(lines) == 2, log[-2000:]
