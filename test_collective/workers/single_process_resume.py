"""One plain process (no fleet.init, no fully_shard) resumes a checkpoint saved by 4
sharded ranks: loads a plain TinyLM and AdamW, trains the last 2 steps on the whole
batch, and matches the uninterrupted sharded run (float64, parity.py's bound). Then the
HFSDP checkpoint worker_hfsdp.py saved (fsdp_outer_sharding "optim": parameters written
by inner blocks, optimizer states by outer sub-blocks) loads into a plain model equal to
the full_state_dict the sharded run had when it saved. argv: the work dir."""

import os
import sys

import numpy as np

import paddle_hsdp  # noqa: F401  (before paddle: its patches apply to plain models too)
from paddle_hsdp import checkpoint
import paddle

from common import max_rel
from parity import report, set_dtype
from models import batches, build_model, make_optimizer, train_on_chunks

work = sys.argv[1]
set_dtype("float64")  # as worker_checkpoint.py saved it
STEPS, SAVE_AT, MICRO, PER_RANK, WORLD, CLIP = 5, 3, 2, 2, 4, 0.2
data = batches(STEPS, MICRO, WORLD, PER_RANK)
model = build_model(seed=7)
opt = make_optimizer(model, model.parameters(), CLIP)
assert checkpoint.load_checkpoint(os.path.join(work, "ckpt"), model, opt) == {"step": SAVE_AT}
losses = train_on_chunks(model, opt, data[SAVE_AT:], range(WORLD), PER_RANK)
ref = np.load(os.path.join(work, "reference.npz"))
worst = {"loss": max_rel(np.array(losses), ref["losses"])}
for name, p in model.named_parameters():
    worst[name] = max_rel(p.numpy(), ref[name.replace(".", "__")])
worst = report("resume in one plain process", worst)
print(f"SINGLE_RESUME max rel diff {worst:.2e}", flush=True)

# consolidate: one safetensors file with the unsharded state_dict keys, for plain Paddle
from safetensors.numpy import load_file  # noqa: E402

out = os.path.join(work, "full.safetensors")
keys = checkpoint.consolidate(os.path.join(work, "ckpt"), out)
plain = build_model(seed=5)
assert sorted(keys) == sorted(plain.state_dict()), (sorted(keys), sorted(plain.state_dict()))
missing, unexpected = plain.set_state_dict({k: paddle.to_tensor(v)
                                            for k, v in load_file(out).items()})
assert not missing and not unexpected, (missing, unexpected)
assert "embed.weight" in checkpoint.describe(os.path.join(work, "ckpt"))
print("CONSOLIDATE_OK", flush=True)

set_dtype("float32")  # as worker_hfsdp.py saved it
plain = build_model(seed=7)
plain_opt = make_optimizer(plain, plain.parameters(), CLIP)
hfsdp = os.path.join(work, "hfsdp_ckpt_optim")
assert checkpoint.load_checkpoint(hfsdp, plain, plain_opt) == {"step": 2}
full = np.load(os.path.join(work, "hfsdp_full.npz"))
assert sorted(full.files) == sorted(k.replace(".", "__") for k in plain.state_dict())
for name, value in plain.state_dict().items():
    assert np.array_equal(value.numpy(), full[name.replace(".", "__")]), name
print("HFSDP_SINGLE_LOAD: equals full_state_dict", flush=True)

# the EP-2 checkpoint worker_checkpoint_moe.py saved (argv[2]) in one plain process
# holding every expert, against the uninterrupted one-process run (float64)
import moe_model  # noqa: E402

set_dtype("float64")
moe_work = sys.argv[2]
n_experts, ep = 2 * moe_model.LOCAL_EXPERTS, 2
data = moe_model.make_data(WORLD)


def plain_moe():
    paddle.seed(5)
    net = moe_model.Net(n_experts, list(range(n_experts)))
    return net, moe_model.make_opt(net, moe_model.CLIP)


ref, ref_opt = plain_moe()
ref_losses = moe_model.train_plain(ref, ref_opt, data, WORLD, ep)
net, net_opt = plain_moe()
for p in net.parameters():  # other weights than the saved ones: loading must matter
    p.set_value(paddle.zeros_like(p))
assert checkpoint.load_checkpoint(os.path.join(moe_work, "ep2"), net, net_opt) == {"step": 2}
losses = moe_model.train_plain(net, net_opt, data[2:], WORLD, ep)
worst = {"loss": max_rel(np.array(losses), np.array(ref_losses[2:]))}
want = ref.state_dict()
for name, value in net.state_dict().items():
    worst[name] = max_rel(value.numpy(), want[name].numpy())
worst = report("moe resume ep2 -> one process", worst)
print(f"MOE_SINGLE_RESUME ep2 -> one process: max rel diff {worst:.2e}", flush=True)
