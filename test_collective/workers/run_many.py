"""Several workers in one launch: one ``fleet.init`` and one set of groups, shared by
workers of the same layout (common.init_fleet), which saves a launch and a fleet.init
(~7 s on 4 CPU ranks here) per worker after the first.

argv: JSON list of ``[worker file, arg, ...]``, run in order, each in a fresh namespace
with its own ``sys.argv`` and float32 as the default dtype (a worker may change it).
Each worker's wall time follows it (``RUN_MANY_TIME <worker> <seconds>``): what it
costs its launch.
"""

import json
import os
import runpy
import sys
import time

import paddle

HERE = os.path.dirname(os.path.abspath(__file__))

for worker, *args in json.loads(sys.argv[1]):
    sys.argv = [os.path.join(HERE, worker), *args]
    paddle.set_default_dtype("float32")
    print(f"RUN_MANY {worker}", flush=True)
    start = time.perf_counter()
    runpy.run_path(sys.argv[0], run_name="__main__")
    print(f"RUN_MANY_TIME {worker} {time.perf_counter() - start:.1f}", flush=True)
