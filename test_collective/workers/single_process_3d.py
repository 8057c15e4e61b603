"""One plain process (no fleet.init, no fully_shard) takes what the 3D workers of the
PaddleFormers launch left in the work dir (issue 33):

* resumes the checkpoint worker_tp_checkpoint.py saved at mp2 x sharding2 outer 2 into a
  plain ``LlamaForCausalLM`` and AdamW (LR scheduler state included), trains the last
  steps on the global batch, and matches the one-process reference (float64,
  parity.py's bound);
* ``consolidate`` of that checkpoint gives the plain model's ``state_dict()`` keys in
  their full shapes, loadable by ``set_state_dict``;
* ``from_pretrained`` of worker_tp_checkpoint.py's mp2 export equals the full weights
  rebuilt here from the mp ranks' slices (joined along their split axes), exactly;
* worker_llama_pipe.py's pp2 checkpoint loads into the plain model, and its export
  with ``from_pretrained``, both equal to its stages' weights, exactly.

argv: the work dir.
"""

import json
import os
import sys

import numpy as np

import paddle_hsdp  # noqa: F401  (before paddle: its patches apply to plain models too)
from paddle_hsdp import checkpoint
import paddle

from common import max_rel
from parity import report, set_dtype
from paddleformers.transformers import LlamaForCausalLM
from tp_llama import batches, llama, make_opt, train

work = sys.argv[1]
STEPS, SAVE_AT, MICRO, ROWS = 4, 2, 2, 4  # as worker_tp_checkpoint.py


def npz_params(path) -> dict:
    return {k.replace("__", "."): v for k, v in np.load(path).items() if k not in ("axes", "losses")}


def exactly(label, got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), (label, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        assert got[name].shape == value.shape, (label, name, got[name].shape, value.shape)
        assert np.array_equal(got[name], value), (label, name)
    print(f"{label}: {len(want)} tensors equal, exactly", flush=True)


# (c) the mp2 x sharding2 outer 2 checkpoint resumed in one process
set_dtype("float64")
paddle.set_default_dtype("float64")
model = llama()
sched = paddle.optimizer.lr.ExponentialDecay(learning_rate=0.02, gamma=0.7)
opt = make_opt(model.parameters(), sched)
ck = os.path.join(work, "tp_ckpt")
assert checkpoint.load_checkpoint(ck, model, opt) == {"step": SAVE_AT}
assert sched.last_epoch == SAVE_AT, sched.last_epoch
losses, _ = train(model, opt, batches(ROWS, STEPS, MICRO)[SAVE_AT:], scheduler=sched)
ref = np.load(os.path.join(work, "tp_reference.npz"))
worst = {"loss": max_rel(np.array(losses), ref["losses"][SAVE_AT:])}
for name, value in model.state_dict().items():
    worst[name] = max_rel(value.numpy(), ref[name.replace(".", "__")])
worst = report("TP_CKPT resume in one process", worst)
print(f"TP_CKPT resume in one process: max rel diff {worst:.2e}", flush=True)

# consolidate: the plain model's keys, full shapes
from safetensors.numpy import load_file  # noqa: E402

out = os.path.join(work, "tp_full.paddle.safetensors")
keys = checkpoint.consolidate(ck, out)
plain = llama()
assert sorted(keys) == sorted(plain.state_dict()), sorted(set(keys) ^ set(plain.state_dict()))
missing, unexpected = plain.set_state_dict({k: paddle.to_tensor(v)
                                            for k, v in load_file(out).items()})
assert not missing and not unexpected, (missing, unexpected)
assert "tp: axis 1 / 2" in checkpoint.describe(ck)
print("TP_CONSOLIDATE: the plain model's keys and full shapes", flush=True)

# the exports (float32: from_pretrained has no float64)
paddle.set_default_dtype("float32")
slices = [np.load(os.path.join(work, f"tp_slices_{r}.npz")) for r in range(2)]
axes = json.loads(str(slices[0]["axes"]))
want = {}
for key in slices[0].files:
    if key == "axes":
        continue
    name = key.replace("__", ".")
    parts = [s[key] for s in slices]
    want[name] = np.concatenate(parts, axis=axes[name]) if name in axes else parts[0]
loaded = LlamaForCausalLM.from_pretrained(os.path.join(work, "tp_export"))
assert loaded.config.tensor_model_parallel_size == 1
exactly("TP_EXPORT from_pretrained", {k: v.numpy() for k, v in loaded.state_dict().items()}, want)

# worker_llama_pipe.py's pp2 checkpoint and export
stages = {}
for r in range(2):
    stages.update(npz_params(os.path.join(work, f"pipe_stage_{r}.npz")))
plain = llama()
checkpoint.load_checkpoint(os.path.join(work, "pipe_ckpt"), plain)
exactly("PIPE_CKPT pp2 -> one process", {k: v.numpy() for k, v in plain.state_dict().items()},
        stages)
loaded = LlamaForCausalLM.from_pretrained(os.path.join(work, "pipe_export"))
exactly("PIPE_EXPORT from_pretrained", {k: v.numpy() for k, v in loaded.state_dict().items()},
        stages)
