"""Muon over HSDP with each matrix owned by one rank (issue 53;
workers/worker_muon.py in the shared 4-rank launch): ``paddle_hsdp.Muon`` with
``owned_matrices()`` at 2 x 2, HFSDP 2 x 2 and 1 x 4 against one process running the
same Muon on the whole batch (5 steps, clip active at every step, weight decay,
float64: losses and every parameter within the parity bound), each matrix's momentum
on its owner only, and Muon over the default row shards refused on every rank."""

from launcher import part_of, run_single

LAYOUTS = {"2x2": 2, "hfsdp 2x2": 1, "1x4": 1}  # layout: copies of the state (replicas)


def test_muon_with_owned_matrices_matches_one_process(hsdp_2x2_log):
    log = part_of(hsdp_2x2_log, "worker_muon.py")
    for layout, copies in LAYOUTS.items():
        line = next((l for l in log.splitlines() if l.startswith(f"MUON {layout}: ")), "")
        assert "max rel diff" in line, (layout, log[-3000:])
        assert f"= {copies} x " in line, line  # the momentum lives on the owners only
    assert "MUON refused on row shards:" in log and "owned_matrices()" in log, log[-3000:]
    assert "MUON done" in log, log[-3000:]


def test_muon_checkpoint_moves_between_placements(hsdp_2x2_log, shared_2x2_work):
    """Saved with owners (2 x 2): loaded into the flat layout and back into owners
    exactly (one more step exact: the momentum came back), into other owners (1 x 4,
    one more step within the bound), and into one process."""
    line = "MUON checkpoint: owned -> flat exact; owned -> owned, one more step exact; " \
        "2x2 owners -> 1x4 owners, one more step"
    assert line in part_of(hsdp_2x2_log, "worker_muon.py")
    assert "loaded exactly" in run_single("single_process_muon.py", shared_2x2_work)
