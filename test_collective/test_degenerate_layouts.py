"""Layouts with nothing (or part of the job) to shard still train right:

* one process, no launcher, sharding_degree=1 (the one-GPU debug run);
* tensor parallelism without sharding (mp2 x sharding1, 2 ranks);
* fleet dp_degree=2 x sharding_degree=2 with an explicit mesh: a mesh that leaves out
  the dp copy is refused, the mesh over every data-parallel rank matches single-process
  training.
"""

from launcher import part_of, run_single


def test_one_process_without_launcher():
    assert "SINGLE_PROCESS_OK" in run_single("single_process.py")


def test_tensor_parallel_without_sharding(launch_2_log):
    log = part_of(launch_2_log, "worker_mp_pp.py")  # the 2-rank launch (conftest.py: MP_ONLY)
    assert log.count("MP_ONLY_PARITY") == 2, log[-2000:]


def test_dp_and_explicit_mesh(launch_4_log):
    log = part_of(launch_4_log, "worker_dp_mesh.py")  # the second 4-rank launch (conftest.py)
    assert log.count("PARITY dp2 x sharding2 mesh 2x2") == 1, log[-2000:]
