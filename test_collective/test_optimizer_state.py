"""Issue 64: the full-size optimizer state of an unsharded run loads with
``opt.set_state_dict`` into 1 x 4, 2 x 2 and HFSDP 2 x 2 shards (each rank keeps its
rows), ``paddle_hsdp.full_optimizer_state_dict`` gives back exactly what went in, and
training goes on as the unsharded run (float64, parity.py's bound); with bfloat16
parameters the float32 master weights and their moments round-trip too. The worker runs in
the shared 2 x 2 launch (conftest.py): workers/worker_full_optim_state.py."""

from launcher import part_of


def test_full_optimizer_state_in_and_out(hsdp_2x2_log, launch_2_log):
    lines = [line for log in (launch_2_log, hsdp_2x2_log)
             for line in part_of(log, "worker_full_optim_state.py").splitlines()
             if line.startswith("FULL_OPTIM_STATE ")]
    print("\n".join(lines))
    for layout in ("1x2", "1x2 optimizer first", "1x4", "2x2", "HFSDP 2x2",
                   "2x2 optimizer first"):
        assert any(line.startswith(f"FULL_OPTIM_STATE {layout}: round trip exact")
                   for line in lines), lines
    for outer_sharding in ("none", "optim"):  # bfloat16 parameters, float32 masters
        assert any(line.startswith(f"FULL_OPTIM_STATE master weights {outer_sharding}: ")
                   and "round trip exact" in line for line in lines), lines
