"""A model sharded from a YAML file alone == the same model sharded by hand, on 4 CPU
ranks, and the plan's bytes == the communication counter's.

The config (written below, nothing else configures the run) asks for bf16 params with
fp32 reduce, recompute on the blocks, prefetch 2, an ignored (frozen) module, a
class-name pattern and 2 outer replicas; ``apply_config`` initialises fleet from it.
The hand-sharded twin makes the same ``fully_shard`` calls without recompute. Both
train 3 optimizer steps of 2 micro-steps: losses and every parameter must be equal bit
for bit (recompute reruns the same float32 kernels on CPU). The YAML run's counter
bytes per (group, op) must equal the plan's prediction exactly.

argv: a directory shared by the ranks.
"""

import os
import sys
import time

import numpy as np

import paddle_hsdp  # noqa: F401  (before fleet.init)
import paddle
import paddle.distributed as dist
import paddle.nn as nn
import paddle.nn.functional as F

from common import assert_same_params, finish, train_loop
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry

VOCAB, H, SEQ, STEPS, MICRO, PER_RANK = 37, 16, 6, 3, 2, 2
CALLS = [0]

CONFIG = """
sharding_size: auto
fsdp_outer_degree: 2
sub_modules_to_wrap:
  - Block              # a class-name pattern: every decoder block
  - embed
ignored_modules:
  - pos                # frozen: not sharded, not synchronised
recompute_modules:
  - blocks.{*}
param_dtype: bf16
reduce_dtype: fp32
num_to_forward_prefetch: 2
num_to_backward_prefetch: 2
"""


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 3 * H + 1)  # odd rows: padding in a 2-way shard
        self.fc2 = nn.Linear(3 * H + 1, H)

    def forward(self, x):
        CALLS[0] += 1  # recompute runs it again in backward
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.pos = nn.Embedding(SEQ, H)
        self.pos.weight.stop_gradient = True
        self.blocks = nn.LayerList([Block() for _ in range(3)])
        self.head = nn.Linear(H, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(paddle.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build():
    paddle.seed(17)
    return Net()


def train(model, data, rank, world):
    def micro_loss(micro, _):
        ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape([-1, VOCAB]), ids[:, 1:].reshape([-1, 1]))

    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters(), weight_decay=0.1)
    return train_loop(opt, data, micro_loss, processes=world)


work = sys.argv[1]
path = os.path.join(work, "hsdp.yaml")
if int(os.environ["PADDLE_TRAINER_ID"]) == 0:
    with open(path + ".tmp", "w") as f:
        f.write(CONFIG)
    os.replace(path + ".tmp", path)
while not os.path.exists(path):  # fleet is not up yet: no barrier to wait on
    time.sleep(0.05)

model, plan = paddle_hsdp.apply_config(build(), path)  # initialises fleet (4 ranks: 2 x 2)
rank, world = dist.get_rank(), dist.get_world_size()
hcg = paddle.distributed.fleet.get_hybrid_communicate_group()
assert (hcg.get_fsdp_outer_group().nranks, hcg.get_fsdp_inner_group().nranks) == (2, 2)
units = hsdp_registry.units_under(model)
assert [u.path() for u in units] == ["blocks.0", "blocks.1", "blocks.2", "embed", "<root>"], \
    [u.path() for u in units]
assert all(getattr(b, "_hsdp_recompute", False) for b in model.blocks)
assert not any(hsdp_registry.managed_param(p) for p in model.pos.parameters())
if rank == 0:
    print(plan, flush=True)

rng = np.random.default_rng(3)
data = rng.integers(0, VOCAB, size=(STEPS, MICRO, world * PER_RANK, SEQ + 1)).astype("int64")
plan.micro_steps = MICRO
comm.counter.reset()
CALLS[0] = 0
yaml_losses = train(model, data, rank, world)
assert CALLS[0] == 2 * 3 * STEPS * MICRO, CALLS  # forward + recompute, 3 blocks
measured = comm.counter.snapshot()
predicted = plan.comm_bytes()
for key, nbytes in predicted.items():
    got = measured.get(key, comm.OpStats()).wire_bytes
    assert abs(got - STEPS * nbytes) < 1e-6 * max(got, 1.0), (key, got, STEPS * nbytes)
# the clip's norm and the first step's agreement on which parameters got grads (a few
# bytes, engine/optimizers.untouched_shards) are not the plan's
wire = {k: v.wire_bytes for k, v in measured.items()
        if k[1] in ("all_gather", "reduce_scatter", "all_reduce")
        and k[0] not in ("clip", "grads present")}
assert set(k for k, v in wire.items() if v) <= set(predicted), (wire, predicted)
print(f"PLAN_BYTES_EQUAL {sorted((f'{k[0]} {k[1]}', v) for k, v in predicted.items())}",
      flush=True)

# the same model, sharded by hand (no recompute: it must not change a bit)
twin = build()
policy = paddle_hsdp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")
ignored = list(twin.pos.parameters())
for module in [*twin.blocks, twin.embed, twin]:
    paddle_hsdp.fully_shard(module, mp_policy=policy, ignored_params=ignored)
twin.set_prefetch_count(forward=2, backward=2)
CALLS[0] = 0
hand_losses = train(twin, data, rank, world)
assert CALLS[0] == 3 * STEPS * MICRO, CALLS
assert yaml_losses == hand_losses, (yaml_losses, hand_losses)
assert_same_params(model, twin)
print(f"YAML_EQUALS_HAND losses {['%.6f' % x for x in yaml_losses]}, "
      f"{len(paddle_hsdp.full_state_dict(model))} tensors bit-identical", flush=True)

# fleet is up now: a config must agree with it ('auto' follows it), refused otherwise
# on every rank before any collective, the model left as it was
units_before = len(hsdp_registry)
for wrong, key in (({"fsdp_outer_degree": 4}, "fsdp_outer_degree"),
                   ({"sharding_size": 4}, "sharding_size")):
    try:
        paddle_hsdp.apply_config(build(), wrong)
        raise AssertionError(f"{wrong} disagrees with the live 2 x 2 topology but was taken")
    except paddle_hsdp.ConfigError as e:
        assert key in str(e) and "live fleet topology" in str(e), e
assert len(hsdp_registry) == units_before
third, _ = paddle_hsdp.apply_config(build(), {"sub_modules_to_wrap": ["blocks.{*}"]})
assert len(hsdp_registry.units_under(third)) == 4
print("LIVE_TOPOLOGY_CHECKED", flush=True)

# the plan's bytes hold at every ZeRO level (fp32, 2 micro-steps per step)
for stage in (1, 2, 3):
    staged, staged_plan = paddle_hsdp.apply_config(
        build(), {"sub_modules_to_wrap": ["blocks.{*}", "embed"], "zero_stage": stage})
    staged_plan.micro_steps = MICRO
    comm.counter.reset()
    train(staged, data[:2], rank, world)
    measured = comm.counter.snapshot()
    for key, nbytes in staged_plan.comm_bytes().items():
        got = measured.get(key, comm.OpStats()).wire_bytes
        assert abs(got - 2 * nbytes) < 1e-6 * max(got, 1.0), (stage, key, got, 2 * nbytes)
    print(f"PLAN_BYTES_EQUAL zero_stage {stage}", flush=True)
finish()
