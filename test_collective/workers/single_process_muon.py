"""One process loads the checkpoint worker_muon.py saved with Muon's matrices owned by
one rank each (2 x 2) into the unsharded model: every parameter as saved, exactly.
argv: the work folder."""

import os
import sys

import numpy as np

import paddle_hsdp
from models import build_model
from parity import set_dtype

work = sys.argv[1]
set_dtype("float64")
model = build_model(seed=99)
paddle_hsdp.load_checkpoint(os.path.join(work, "muon_owned"), model)
saved = np.load(os.path.join(work, "muon_owned_params.npz"))
state = model.state_dict()
assert set(saved.files) == set(state), set(saved.files) ^ set(state)
for name in saved.files:
    assert np.array_equal(saved[name], state[name].numpy()), name
print(f"MUON one process: {len(saved.files)} tensors loaded exactly", flush=True)
