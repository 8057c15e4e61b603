"""Layouts with nothing (or part of the job) to shard still train right:

* one process, no launcher, sharding_degree=1 (the one-GPU debug run);
* tensor parallelism without sharding (mp2 x sharding1, 2 ranks);
* fleet dp_degree=2 x sharding_degree=2 with an explicit mesh: a mesh that leaves out
  the dp copy is refused, the mesh over every data-parallel rank matches single-process
  training.
"""

import json
import os
import subprocess
import sys

from launcher import HERE, ROOT, launch


def test_one_process_without_launcher():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(HERE, "workers")]),
               GLOG_minloglevel="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "workers", "single_process.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SINGLE_PROCESS_OK" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-4000:]


def test_tensor_parallel_without_sharding():
    config = {"mp_degree": 2, "sharding_degree": 1, "outer": 1, "tag": "MP_ONLY",
              "fleet_opt": [False, True]}
    log = launch(2, "worker_mp_pp.py", json.dumps(config), timeout=600)
    assert log.count("MP_ONLY_PARITY") == 2, log[-2000:]


def test_dp_and_explicit_mesh():
    log = launch(4, "worker_dp_mesh.py", timeout=600)
    assert log.count("PARITY dp2 x sharding2 mesh 2x2") == 1, log[-2000:]
