"""fully_shard(mesh=ProcessMesh) on 4 real CPU ranks after init_parallel_env only (no
fleet sharding config): a 2 x 2 and a 1-D mesh match single-process training (losses,
every final parameter, the global grad norm; rtol 1e-5), and two disjoint 1-D meshes
train side by side, ranks outside a mesh keeping group numbering in step."""

from launcher import launch


def test_mesh_argument_parity():
    log = launch(4, "worker_mesh.py", timeout=600)
    assert log.count("PARITY mesh 2x2") == 1, log[-2000:]
    assert log.count("PARITY mesh 4") == 1, log[-2000:]
    assert log.count("PARITY mesh 2 ") == 1, log[-2000:]  # rank 0's half-world mesh
