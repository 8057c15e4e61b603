"""Usage patterns real training loops have, through the engine on the one-rank fake mesh
of kit.py (every collective is a copy: this checks the hooks and the grad
plumbing, not multi-rank numerics, which test_collective covers).

Each test trains the sharded model and an unsharded twin the same way and compares.
"""

import dataclasses

import numpy as np
import pytest

import paddle
import paddle.nn as nn
from paddle.distributed.fleet.utils import recompute

import paddle_hsdp
from paddle_hsdp.engine.registry import registry as hsdp_registry
from kit import parity

H = 8


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x, scale=None):
        y = paddle.tanh(self.fc(x))
        return x + (y * scale if scale is not None else y)


@dataclasses.dataclass
class Output:
    logits: paddle.Tensor
    aux: paddle.Tensor


class Net(nn.Layer):
    """Embedding + blocks; ``mode`` picks how the blocks are called."""

    def __init__(self, mode="plain", n=3):
        super().__init__()
        self.embed = nn.Embedding(11, H)
        self.blocks = nn.LayerList([Block() for _ in range(n)])
        self.head = nn.Linear(H, 11)
        self.mode = mode

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            if self.mode == "recompute":
                x = recompute(block, x)
            elif self.mode == "recompute_nonreentrant":
                x = recompute(block, x, use_reentrant=False)
            elif self.mode == "kwargs":
                x = block(x=x, scale=paddle.full([1], 0.5))
            else:
                x = block(x)
        if self.mode == "recompute_head":  # the root's head grads come from a nested
            # backward, and the head weight is read once more outside it
            logits = recompute(self.head, x) + self.head.weight.mean()
        else:
            logits = self.head(x)
        return Output(logits=logits, aux=(x * x).mean()) if self.mode == "dataclass" else logits


def _loss(out, ids):
    logits = out.logits if isinstance(out, Output) else out
    loss = nn.functional.cross_entropy(logits.reshape([-1, 11]), ids.reshape([-1, 1]))
    return loss + 0.1 * out.aux if isinstance(out, Output) else loss


def _pair(mode="plain", stage=None):
    paddle.seed(3)
    ref = Net(mode)
    paddle.seed(3)
    model = Net(mode)
    for block in model.blocks:
        paddle_hsdp.fully_shard(block)
    paddle_hsdp.fully_shard(model)
    if stage is not None:
        paddle_hsdp.set_zero_stage(model, stage)
    return ref, model


def _batch(step):
    return paddle.to_tensor(np.random.default_rng(step).integers(0, 11, (2, 5)).astype("int64"))


def _assert_same(model, ref):
    """Every parameter within parity.py's bound (the tests here run in float64)."""
    full = paddle_hsdp.full_state_dict(model)
    for name, p in ref.named_parameters():
        parity.assert_close(full[name].numpy(), p.numpy(), name)


def _train(model, opt, steps=3, micro=2, before_step=None, skip=None):
    for step in range(steps):
        for m in range(micro):
            ids = _batch(10 * step + m)
            (_loss(model(ids), ids) / micro).backward()
        if before_step is not None:
            before_step(model, opt)
        if skip == step:
            opt.clear_grad()  # a skipped batch: its grads must be gone
            continue
        opt.step()
        opt.clear_grad()


@pytest.mark.parametrize("mode", ["recompute", "recompute_nonreentrant", "recompute_head",
                                  "kwargs", "dataclass"])
def test_call_patterns_train_like_the_unsharded_model(fake_mesh, float64, mode):
    """Activation recompute (reentrant and not; of a block, or of the root's head, whose
    buffer is reduced early), tensors passed as keyword arguments and a dataclass output
    all get their grads reduced once per backward."""
    ref, model = _pair(mode)
    for m in (ref, model):
        opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters())
        _train(m, opt)
    _assert_same(model, ref)
    assert not any(u.is_root for u in hsdp_registry.units_under(model)
                   if u.module is not model), "a recomputed unit was taken for a root"


def test_param_groups_get_the_hsdp_clip(fake_mesh, float64):
    """Each parameter group's ClipGradByGlobalNorm is swapped too (Paddle clips groups
    with their own copy), and the update matches the unsharded model's."""
    ref, model = _pair()
    for m in (ref, model):
        params = list(m.parameters())
        opt = paddle.optimizer.AdamW(0.05, parameters=[
            {"params": params[:2], "learning_rate": 0.5}, {"params": params[2:]}],
            grad_clip=nn.ClipGradByGlobalNorm(0.05))
        _train(m, opt)
        if m is model:
            assert all(isinstance(g["grad_clip"], paddle_hsdp.HSDPClipGradByGlobalNorm)
                       for g in opt._param_groups)
    _assert_same(model, ref)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clear_grad_without_step_drops_the_batch(fake_mesh, float64, stage):
    """A batch dropped with clear_grad (no step) leaves no trace, at every ZeRO level
    (ZeRO-1 keeps unreduced full-size grads until the step: those go too)."""
    ref, model = _pair(stage=stage)
    for m in (ref, model):
        opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters())
        _train(m, opt, skip=1)
    _assert_same(model, ref)


def test_reading_synced_grads_before_more_micro_steps(fake_mesh, float64):
    """finish_grad_sync in the middle of accumulation (to log grads), then more
    micro-steps: the step still sees the plain sum of all micro-steps. A divide factor
    of 4 (the reference scales its loss by 1/4; SGD is linear in the grad) makes the
    re-scaling of already synced grads visible even on one rank."""
    ref, model = _pair()
    model.set_gradient_divide_factor(4.0)

    def peek(m, o):
        if m is model:
            paddle_hsdp.finish_grad_sync(o)
        ids = _batch(99)
        loss = _loss(m(ids), ids) / 2
        (loss if m is model else loss / 4).backward()

    def train(m):
        opt = paddle.optimizer.SGD(0.5, parameters=m.parameters())
        for step in range(3):
            for k in range(2):
                ids = _batch(10 * step + k)
                loss = _loss(m(ids), ids) / 2
                (loss if m is model else loss / 4).backward()
            peek(m, opt)
            opt.step()
            opt.clear_grad()

    train(ref)
    train(model)
    _assert_same(model, ref)


def test_unfreezing_after_fully_shard_is_refused(fake_mesh):
    """Flipping stop_gradient on a shard after sharding would silently never train it:
    the next forward says what to do instead."""
    ref, model = _pair()
    model.blocks[0].fc.weight.stop_gradient = True
    with pytest.raises(RuntimeError, match="before fully_shard"):
        model(_batch(0))
