"""Issue 61: ranks that build the model from different seeds (as PaddleFormers' command
line seeds them) train one model: fully_shard takes every parameter and buffer from the
first rank of each FSDP group (sync_module_states=True, the default), so the run equals
the one-process run started from rank 0's weights (float64, parity.py's bound) at 1 x 2,
2 x 2, HFSDP 2 x 2 and tensor parallelism 2 x HSDP 2 x 2; with sync_module_states=False,
unequal weights are refused on every rank before anything changes (the model is then
sharded with the default and trains right), equal ones pass with fingerprints only.

The workers run in the shared launches (conftest.py): workers/worker_agreement.py in the
2-rank and the shared 2 x 2 launch, workers/worker_mp_pp.py (MP_8_APART) in the 8-rank one.
"""

import pytest

from launcher import part_of


def _lines(log: str, worker: str, marker: str) -> list[str]:
    return [line for line in part_of(log, worker).splitlines() if line.startswith(marker)]


@pytest.mark.parametrize("fixture,shape,runs", [("launch_2_log", "1x2", ["none"]),
                                                ("hsdp_2x2_log", "2x2", ["none", "optim"])])
def test_ranks_seeded_apart_train_rank_0s_model(fixture, shape, runs, request):
    lines = _lines(request.getfixturevalue(fixture), "worker_agreement.py", "AGREEMENT ")
    print("\n".join(lines))
    for run in runs:
        assert any(line.startswith(f"AGREEMENT {shape} {run}: seeded apart") for line in lines), lines
    assert any(f"AGREEMENT {shape}: refused on rank 0, then usable" in line for line in lines)
    assert any(f"AGREEMENT {shape}: equal weights, no sync" in line for line in lines)


def test_tensor_parallel_ranks_seeded_apart(launch_8_log):
    lines = [line for line in part_of(launch_8_log, "worker_mp_pp.py").splitlines()
             if line.startswith("MP_APART_PARITY")]
    print("\n".join(lines))
    assert len(lines) == 1, part_of(launch_8_log, "worker_mp_pp.py")[-2000:]
