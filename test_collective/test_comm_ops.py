"""comm.* collectives on real CPU ranks (gloo): exact results in every dtype and mode,
on the inner, outer and FSDP groups, and exactly counted traffic."""


def test_comm_ops_4_ranks_sharding4_outer2(hsdp_2x2_log):
    """reduce_scatter / all_gather / all_reduce / broadcast x fp32/bf16/fp16 x sync/async;
    first, a misspelt fsdp_outer_degree is refused on every rank before any group exists
    (the launch fails unless every rank raised, with the suggestion)."""
    log = hsdp_2x2_log  # workers/worker_comm.py, in the shared 2 x 2 launch (conftest.py)
    assert "rank 0 refused the misspelt option before any group" in log
    assert "rank 0 dense: fsdp [0, 1, 2, 3] inner [0, 1] outer [0, 2]" in log
    assert ("rank 0 comm ops ok: 72 checks, groups inner=[0, 1] outer=[0, 2] "
            "fsdp=[0, 1, 2, 3]") in log
