"""HFSDP, ``fsdp_outer_sharding="optim"`` (workers/worker_hfsdp.py): the optimizer state
sharded across the outer group too. In the shared 2 x 2 launch (fully_shard's keyword on
fleet's HSDP groups) and the 2 x 4 layout of the 8-rank launch (fleet's sharding_configs option,
inherited by the units): float32 parity with one process on the whole batch (AdamW,
active clipping, 3 micro-steps, a skipped batch, an early finish_grad_sync; in 2 x 2 also
ZeRO-1, ZeRO-2 and fleet.distributed_optimizer), replicas bit-identical every step, one
outer reduce-scatter plus one outer all-gather per buffer per step carrying HSDP's outer
bytes, optimizer state 1/O per rank; in 2 x 2 also the checkpoints (HSDP <-> HFSDP
exact, HFSDP -> HFSDP bit for bit, set_state_dict, flex_checkpoint's sub-shards; the
one-process load of the HFSDP checkpoint runs in test_checkpoint.py); in 2 x 4 same-layout
HSDP and HFSDP loads that read the files once. The MoE (EP 2, 8
ranks) run is in test_moe.py, bf16 params with fp32 reduce (and with offload forced on
CPU) in test_knobs.py."""

import pytest


@pytest.mark.parametrize("fixture,shape", [("hsdp_2x2_log", "2x2"), ("hsdp_2x4_log", "2x4")])
def test_hfsdp_parity_counter_memory(fixture, shape, request):
    log = request.getfixturevalue(fixture)
    assert log.count(f"HFSDP_PARITY {shape} float32: max rel diff") == 1, log[-3000:]


def test_hfsdp_zero_levels_and_fleet_optimizer(hsdp_2x2_log):
    for name in ("zero1", "zero2", "fleet_opt"):
        assert log_has(hsdp_2x2_log, f"HFSDP_VARIANT {name}: max rel diff")


def test_hfsdp_checkpoints(hsdp_2x2_log):
    for move in ("none->optim", "optim->none", "optim->optim"):
        assert log_has(hsdp_2x2_log, f"HFSDP_RESUME {move}: saved state loaded exactly")
    assert log_has(hsdp_2x2_log, "HFSDP_FLEX: sub-shards tile every tensor")
    assert log_has(hsdp_2x2_log, "HFSDP_SET_STATE_DICT: full tensors in")


def test_2x4_loads_read_the_files_once(hsdp_2x4_log):
    """Issue 51: HSDP and HFSDP 2 x 4 loads whose ranks' bytes read from the files sum
    to the files' tensor bytes exactly once (counted in the worker)."""
    for mode in ("none", "optim"):
        assert log_has(hsdp_2x4_log, f"LOAD_READS 2x4 {mode}: ")


def log_has(log: str, text: str) -> bool:
    assert text in log, (text, log[-3000:])
    return True
