"""Checkpoints on 4 CPU ranks (fleet sharding 4, fsdp_outer_degree 2): train 3 steps in
2x2, save, load into 2x2 (bit-exact continuation), 1x4 and 4x1 explicit meshes (float64,
parity.py's bound), train 2 more steps and compare with an uninterrupted 5-step run; the
same from the step-3 checkpoint the engine wrote before its segment layout; a save that
fails on one rank leaves the previous checkpoint intact on every rank; a corrupted
file and another model are refused on every rank with nothing changed.

argv: a directory shared by the ranks (the test's tmp dir).
"""

import os
import shutil
import sys

import numpy as np
from common import finish, init_fleet, max_rel
from parity import report, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.checkpoint import load as checkpoint_load
from paddle_hsdp.checkpoint import save as checkpoint_save
from models import batches, build_model, make_optimizer, shard_tinylm, train_steps

STEPS, SAVE_AT, MICRO, PER_RANK, CLIP = 5, 3, 2, 2, 0.2
set_dtype("float64")  # parity.py: the cross-layout resumes are held to float64's bound

work = sys.argv[1]
hcg = init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, MICRO, world, PER_RANK)
CK = os.path.join(work, "ckpt")


def shard(mesh=None):
    # other weights than the saved run: loading must matter
    model = shard_tinylm(build_model(seed=99), mesh=mesh)
    return model, make_optimizer(model, model.parameters(), CLIP)


def train(model, opt, steps):
    return train_steps(model, opt, [data[i] for i in steps], rank, world, PER_RANK)


def params(model):
    return {k: v.numpy() for k, v in paddle_hsdp.full_state_dict(model).items()}


# the uninterrupted run, and the run that saves after step 3
model = shard_tinylm(build_model())
opt = make_optimizer(model, model.parameters(), CLIP)
ref_losses = train(model, opt, range(STEPS))
ref_params = params(model)
if rank == 0:
    np.savez(os.path.join(work, "reference.npz"), losses=np.array(ref_losses[SAVE_AT:]),
             **{k.replace(".", "__"): v for k, v in ref_params.items()})

model = shard_tinylm(build_model())
opt = make_optimizer(model, model.parameters(), CLIP)
train(model, opt, range(SAVE_AT))
checkpoint.save_checkpoint(CK, model, opt, extra={"step": SAVE_AT})
meta = checkpoint.read_metadata(CK)
assert meta["aliases"] == {"head.weight": "embed.weight"}, meta["aliases"]
writers = {p["file"] for t in meta["tensors"].values() for p in t["pieces"] if "file" in p}
assert len(writers) == 4, writers  # both outer replicas write: the work is spread
# the beta powers (one number per parameter, held by every rank) sit in the metadata
scalars = [p for n, t in meta["tensors"].items() if n.endswith("_pow_acc") for p in t["pieces"]]
assert scalars and all("value" in p and "file" not in p for p in scalars), scalars[:2]
for name, t in meta["tensors"].items():  # each distinct block once
    assert sum(np.prod(p["shape"]) for p in t["pieces"]) == np.prod(t["shape"] or [1]), name

# an async save: it returns before the files exist, training goes on, and once
# published it holds the state of the step it was called at, bit for bit
CK_ASYNC = os.path.join(work, "ckpt_async")
handle = checkpoint.save_checkpoint(CK_ASYNC, model, opt, extra={"step": SAVE_AT},
                                    async_save=True)
assert not os.path.exists(CK_ASYNC)  # published by wait(), not before
train(model, opt, [SAVE_AT])  # the next step runs while the files are written
handle.wait()
sync_probe, sync_probe_opt = shard()
async_probe, async_probe_opt = shard()
checkpoint.load_checkpoint(CK, sync_probe, sync_probe_opt)
assert checkpoint.load_checkpoint(CK_ASYNC, async_probe, async_probe_opt) == {"step": SAVE_AT}
a, b = params(sync_probe), params(async_probe)
assert all(np.array_equal(a[k], b[k]) for k in a), "the async save is not the step's state"
print("ASYNC_SAVE: returned before the files existed, loads the step's state exactly",
      flush=True)

# every load reads the checkpoint from storage once, whatever the outer degree: the
# outer replicas split the reading (checkpoint/load.py); counted here on every rank
readers = []


class CountingReader(checkpoint_load.Reader):
    def __init__(self, path):
        super().__init__(path)
        readers.append(self)


checkpoint_load.Reader = CountingReader
in_files = sum(int(np.prod(p["shape"])) * np.dtype(
    "uint16" if t["dtype"] == "bfloat16" else t["dtype"]).itemsize
    for t in meta["tensors"].values() for p in t["pieces"] if "file" in p)

# resume in each layout and train the last 2 steps
for label, mesh in (("2x2", None), ("1x4", ProcessMesh([0, 1, 2, 3])),
                    ("4x1", ProcessMesh([[0], [1], [2], [3]], dim_names=["outer", "inner"]))):
    resumed, resumed_opt = shard(mesh)
    readers.clear()
    extra = checkpoint.load_checkpoint(CK, resumed, resumed_opt)
    assert extra == {"step": SAVE_AT}, extra
    read = paddle.to_tensor([sum(r.bytes_read for r in readers)], dtype="int64")
    dist.all_reduce(read)
    # 1x4 cuts each saved block (one CRC chunk: the model is tiny) in two, and a rank
    # reads whole CRC chunks: both ranks of a block read it. Where the boxes line up,
    # exactly once, though 2x2 and 4x1 have 2 and 4 outer replicas.
    got_read = int(read.item())
    assert got_read == in_files if label != "1x4" else in_files < got_read <= 2 * in_files, \
        (label, got_read, in_files)
    print(f"LOAD {label}: {got_read} bytes read by all ranks, the checkpoint's {in_files}",
          flush=True)
    losses = train(resumed, resumed_opt, range(SAVE_AT, STEPS))
    got = params(resumed)
    if label == "2x2":  # the same layout: bit for bit
        assert losses == ref_losses[SAVE_AT:], (losses, ref_losses[SAVE_AT:])
        assert all(np.array_equal(got[k], ref_params[k]) for k in ref_params)
        worst = 0.0
    else:
        worst = report(f"resume {label}", dict(
            {k: max_rel(got[k], ref_params[k]) for k in ref_params},
            loss=max_rel(np.array(losses), np.array(ref_losses[SAVE_AT:]))))
    print(f"RESUME {label}: max rel diff {worst:.2e}", flush=True)

# test/data/checkpoint_v2_row_blocks: this run's step-3 checkpoint as the engine wrote it
# before the segment layout (commit b589f06: every parameter in equal dim-0 blocks, the
# same format, other boxes); it loads into today's layout and continues as the
# uninterrupted run does
OLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "test",
                   "data", "checkpoint_v2_row_blocks")
resumed, resumed_opt = shard()
assert checkpoint.load_checkpoint(OLD, resumed, resumed_opt) == {"step": SAVE_AT}
losses = train(resumed, resumed_opt, range(SAVE_AT, STEPS))
got = params(resumed)
worst = report("resume from the row-block layout", dict(
    {k: max_rel(got[k], ref_params[k]) for k in ref_params},
    loss=max_rel(np.array(losses), np.array(ref_losses[SAVE_AT:]))))
print(f"RESUME row-block checkpoint: max rel diff {worst:.2e}", flush=True)

# a save that fails on one rank: every rank raises, the previous checkpoint stays
before = open(os.path.join(CK, "metadata.json")).read()
original_write = checkpoint_save._write_rank_file


def failing_write(path, tensors, header=None):
    if rank == 1:
        raise OSError("disk full (injected)")
    original_write(path, tensors, header)


for async_save in (False, True):  # async: the background write fails, wait() raises
    checkpoint_save._write_rank_file = failing_write
    try:
        handle = checkpoint.save_checkpoint(CK, model, opt, extra={"step": 99},
                                            async_save=async_save)
        if handle is not None:
            handle.wait()
        raise AssertionError(f"a failed save did not raise (async_save={async_save})")
    except checkpoint.CheckpointError as e:
        assert "disk full" in str(e), e
    checkpoint_save._write_rank_file = original_write
    assert open(os.path.join(CK, "metadata.json")).read() == before
    assert not [d for d in os.listdir(work) if ".tmp-" in d], os.listdir(work)
probe, probe_opt = shard()
assert checkpoint.load_checkpoint(CK, probe, probe_opt) == {"step": SAVE_AT}
print("SAVE_FAILURE: every rank raised, previous checkpoint intact", flush=True)

# a corrupted file, and another model: refused on every rank, nothing changed
bad = os.path.join(work, "ckpt_bad")
if rank == 0:
    shutil.copytree(CK, bad)
    victim = os.path.join(bad, "rank-00003.safetensors")
    raw = bytearray(open(victim, "rb").read())
    raw[-8] ^= 0xFF  # a byte of tensor data
    open(victim, "wb").write(bytes(raw))
dist.barrier()
untouched = params(probe)
try:
    checkpoint.load_checkpoint(bad, probe, probe_opt)
    raise AssertionError("a corrupted checkpoint loaded")
except checkpoint.CheckpointError as e:
    print(f"CORRUPTED rank {rank}: {str(e)[:120]}", flush=True)
now = params(probe)  # one gather (a collective), then compare key by key
assert all(np.array_equal(now[k], untouched[k]) for k in untouched)
other = paddle.nn.Sequential(paddle.nn.Linear(8, 8))
paddle_hsdp.fully_shard(other)
try:
    checkpoint.load_checkpoint(CK, other)
    raise AssertionError("another model's checkpoint loaded")
except checkpoint.CheckpointError as e:
    assert "does not match this model" in str(e), e
print("REFUSED: corrupted file and another model", flush=True)

# Paddle's flex_checkpoint: sharded_state_dict() gives ShardedWeights (views of the
# shards at their global row offsets) that dcp saves and loads back in place. On CPU
# dcp's reshard path calls .cuda(), so only a same-layout load with save_replicas
# (every piece local) runs here.
from paddle.distributed.flex_checkpoint.dcp.load_state_dict import load_state_dict  # noqa: E402
from paddle.distributed.flex_checkpoint.dcp.save_state_dict import save_state_dict  # noqa: E402

dcp_path = os.path.join(work, "dcp")
sd = model.sharded_state_dict()
osd = opt.sharded_state_dict(sd)  # Paddle's AdamW naming: KEY.moment1_0, KEY.beta1_pow_acc_0
# a rank that holds no row of a parameter describes none of it (engine/layout.py)
holds = "blocks.0.fc1.weight" in sd
assert holds == ("blocks.0.fc1.weight.moment1_0" in osd), osd.keys()
assert not holds or sd["blocks.0.fc1.weight"].global_shape == (8, 25)
assert not holds or osd["blocks.0.fc1.weight.moment1_0"].global_shape == (8, 25)
holders = paddle.to_tensor([int(holds)], dtype="int64")
dist.all_reduce(holders)
assert int(holders) >= 1, "no rank holds blocks.0.fc1.weight"
save_state_dict({**sd, **osd}, dcp_path, save_replicas=True)
fresh, fresh_opt = shard()
fresh_sd = fresh.sharded_state_dict()
load_state_dict({**fresh_sd, **fresh_opt.sharded_state_dict(fresh_sd)}, dcp_path)
expected = params(model)
loaded = params(fresh)
assert all(np.array_equal(loaded[k], expected[k]) for k in expected)
for key, weight in osd.items():
    loaded = fresh_opt.sharded_state_dict(fresh_sd)[key].local_tensor.numpy()
    assert np.array_equal(loaded, weight.local_tensor.numpy()), key
# the optimizer state is really in place: one more step goes exactly as the original's
step = [data[SAVE_AT]]
assert train_steps(fresh, fresh_opt, step, rank, world, PER_RANK) == \
    train_steps(model, opt, step, rank, world, PER_RANK)
after = params(model)
stepped = params(fresh)
assert all(np.array_equal(stepped[k], after[k]) for k in after)
print(f"FLEX_CHECKPOINT: same-layout dcp round trip of params and {len(osd)} optimizer "
      "states bit-identical, next step identical", flush=True)
finish()
