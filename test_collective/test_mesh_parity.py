"""fully_shard(mesh=ProcessMesh) on 4 real CPU ranks after init_parallel_env only (no
fleet sharding config): a 2 x 2 and a 1-D mesh match single-process training (losses,
every final parameter, the global grad norm; rtol 1e-5), and two disjoint 1-D meshes
train side by side, ranks outside a mesh keeping group numbering in step."""

from launcher import part_of


def test_mesh_argument_parity(launch_4_log):
    # the first worker of the second 4-rank launch (conftest.py), before any fleet.init
    log = part_of(launch_4_log, "worker_mesh.py")
    assert log.count("PARITY mesh 2x2") == 1, log[-2000:]
    assert log.count("PARITY mesh 4") == 1, log[-2000:]
    assert log.count("PARITY mesh 2 ") == 1, log[-2000:]  # rank 0's half-world mesh
