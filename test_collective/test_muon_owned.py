"""Muon over HSDP with each matrix owned by one rank (issue 53;
workers/worker_muon.py in the shared 4-rank launch): ``paddle_hsdp.Muon`` with
``owned_matrices()`` at 2 x 2 (a block a unit, and every block in the root unit: the
owners then span the replicas), HFSDP 2 x 2, 1 x 4 and 2 x 2 offloaded against one
process running the same Muon on the whole batch (5 steps, clip active at every step,
weight decay, float64: losses and every parameter within the parity bound), each
matrix's momentum on its owner only and orthogonalised once per job (the Newton-Schulz
flops over the ranks, issue 65); Muon over the default placement moved onto owners
at its first step (1 x 4, HFSDP 2 x 2, issue 64) and trained alike; over rows asked
explicitly (Shard(0)) refused on every rank. Next to tensor parallelism (TP 2 x HSDP 2 x 2, the mp slices joined for
Newton-Schulz, each once per mp group: the Newton-Schulz flops counted) and expert
parallelism (EP 2, the experts as 3-D stacks):
workers/worker_muon_3d.py in the 8-rank launch, 4 steps each against the whole model in
one process."""

from launcher import part_of, run_single, worker_sections

# layout: the replicas keeping their inner owners (1: the owners span inner x outer,
# or one replica). Issue 65: under plain HSDP each of the 2 replicas keeps its inner
# owners, each matrix goes to one of them, which alone keeps its momentum (one copy of
# the state in every layout) and, from the second step, alone receives its grad: the
# packed reduce-scatter (not where the grads are offloaded)
LAYOUTS = {"2x2": 2, "2x2 root only": 2, "hfsdp 2x2": 1, "1x4": 1, "4x1": 1, "2x2 offload": 2,
           "1x4 moved": 1, "hfsdp 2x2 moved": 1, "2x2 4 micro-steps": 2,
           "2x2 default placement": 2}
PACKED = ("2x2", "2x2 root only", "2x2 4 micro-steps", "2x2 default placement")


def test_muon_with_owned_matrices_matches_one_process(hsdp_2x2_log):
    log = part_of(hsdp_2x2_log, "worker_muon.py")
    for layout, copies in LAYOUTS.items():
        line = next((l for l in log.splitlines() if l.startswith(f"MUON {layout}: ")), "")
        assert "max rel diff" in line, (layout, log[-3000:])
        assert "= 1 x " in line, line  # the momentum lives on one owner in the job
        if layout != "2x2 4 micro-steps":  # (its own reference)
            assert "full_optimizer_state_dict: " in line, line
        # issue 65: each matrix orthogonalised once per job, replicas that keep their
        # inner owners included (each does its share, the results all-gathered)
        assert "Newton-Schulz flops over the ranks" in line and "= 1 x the model's" in line, line
        if copies == 2:  # every buffer keeps inner owners: one all-gather a step (item 4)
            assert "Muon's all-gathers over the outer group 1 a step" in line, line
        if layout in PACKED:  # one packed reduce-scatter a step, whatever the matrices
            assert "reduce-scatters 1 a step from the second" in line, line
    for moved in ("1x4 moved", "hfsdp 2x2 moved"):  # issue 64: the default placement
        assert f"MUON {moved}: laid out as owned_matrices() after its first step" in log
    assert "MUON refused on row shards:" in log and "owned_matrices()" in log, log[-3000:]
    assert "MUON refused apart: set_requires_all_reduce(False) at the step" in log
    assert "MUON done" in log, log[-3000:]


def test_muon_checkpoint_moves_between_placements(hsdp_2x2_log, shared_2x2_work):
    """Saved with owners (2 x 2): loaded into the flat layout and back into owners
    exactly (one more step exact: the momentum came back), into other owners (1 x 4,
    one more step within the bound), and into one process."""
    line = "MUON checkpoint: owned -> flat exact; owned -> owned, one more step exact; " \
        "2x2 owners -> 1x4 owners, one more step"
    log = part_of(hsdp_2x2_log, "worker_muon.py")
    assert line in log
    # issue 65: the momentum on the owning replica only, against every replica's copy
    assert "MUON checkpoint: momentum on the owning replica -> on every replica, one " \
        "more step" in log and "every replica -> the owning replica, one more step" in log
    # the layout of before 2026-12-07 (owners over inner x outer) into the packed exchange
    assert "MUON checkpoint: spread owners -> packed exchange, two more steps" in log
    assert "loaded exactly" in run_single("single_process_muon.py", shared_2x2_work)


def test_muon_next_to_tensor_and_expert_parallelism(launch_8_log):
    """Every rank's parameters and the losses within the bound (rank 0 prints the worst
    over the 8 ranks): TP 2 x HSDP 2 x 2 with the four mp-split matrices joined over
    the mp group, and EP 2 with 3-D expert stacks in the expert inner group."""
    log = "\n".join(text for worker, text in worker_sections(launch_8_log)
                     if worker == "worker_muon_3d.py")
    assert "MUON_3D tp2 x hsdp 2x2: max rel diff" in log and \
        "(4 mp-split matrices joined for Newton-Schulz, each orthogonalised once per mp " \
        "group)" in log, log[-3000:]
    assert "MUON_3D ep2 3-D stacks: max rel diff" in log, log[-3000:]
    assert "MUON_3D tp done" in log and "MUON_3D ep done" in log, log[-3000:]
