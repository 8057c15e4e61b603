"""Every user-facing entry point refuses bad input clearly: the bad-input table of
docs/faults.md is generated from the rows below and checked to be in that file, so the
two cannot drift apart.

Each row builds its situation in one process (the one-rank fake mesh stands in for
fleet's groups), makes the bad call, and checks the exception type, that the message
names the argument and what is allowed, and, for calls on a model, that the model
still trains afterwards (the check ran before anything changed and before any
collective, so every rank raises alike and nothing hangs). Cases that need several
ranks (a unit run on some ranks only, mismatched collectives, a dead rank) are in
test_collective/ and listed at the end of the docs/faults.md table.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import paddle
import pytest

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.__main__ import main as cli
from paddle_hsdp.topology import fleet as fleet_ext
from paddle_hsdp.topology import layout as topology
from test_checkpoint_3d import FakeHCG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS: list["Row"] = []


@dataclass
class Row:
    entry: str  # the entry point, as docs/faults.md names it
    bad: str  # the bad input, as code
    error: type
    says: tuple  # fragments the message must contain (the argument, allowed values)
    run: Callable  # makes the bad call; asks for `model` / `net` to have it checked after


def row(entry, bad, error, *says):
    def register(fn):
        ROWS.append(Row(entry, bad, error, says, fn))
        return fn
    return register


def _net():
    paddle.seed(3)
    return paddle.nn.Sequential(paddle.nn.Linear(4, 6), paddle.nn.GELU(), paddle.nn.Linear(6, 2))


def _sharded():
    model = _net()
    paddle_hsdp.fully_shard(model[0])
    paddle_hsdp.fully_shard(model)
    return model


class _Lm(paddle.nn.Layer):  # for config patterns
    def __init__(self):
        super().__init__()
        self.layers = paddle.nn.LayerList([paddle.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------- fleet.init options
def _validate(degree, sharding=4):
    return topology.validate_outer_degree(degree, {"dense": sharding})


@row("fleet.init: `sharding_configs['fsdp_outer_degree']`", '"2" (a string)', ValueError,
     "fsdp_outer_degree", "must be an int", "valid choices")
def _degree_type():
    _validate("2")


@row("fleet.init: `sharding_configs['fsdp_outer_degree']`", "3 with sharding_degree 4",
     ValueError, "fsdp_outer_degree", "divide", "valid choices: [1, 2, 4]")
def _degree_divides():
    _validate(3)


@row("fleet.init: `sharding_configs['fsdp_outer_degree']`", "0", ValueError,
     "fsdp_outer_degree", ">= 1")
def _degree_zero():
    _validate(0)


@row("fleet.init: `sharding_configs['fsdp_outer_degree']`", "2 with `strategy.semi_auto`",
     NotImplementedError, "fsdp_outer_degree", "auto-parallel", "set it to 1")
def _degree_auto_parallel():
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"sharding_degree": 4, "sharding_configs": {"fsdp_outer_degree": 2}}
    strategy.semi_auto = True
    fleet_ext.validate_strategy(strategy)


def _strategy_with(sharding_configs):
    from paddle.distributed import fleet

    fleet.DistributedStrategy().hybrid_configs = {"sharding_degree": 4,
                                                  "sharding_configs": sharding_configs}


@row("`strategy.hybrid_configs`: `sharding_configs` keys", "`{'fsdp_outer_degre': 2}` (a typo)",
     ValueError, "'fsdp_outer_degre'", "did you mean 'fsdp_outer_degree'?", "split_param")
def _sharding_configs_typo():
    _strategy_with({"fsdp_outer_degre": 2})


@row("`strategy.hybrid_configs`: `sharding_configs` keys", "`{'bogus_key': 1}`", ValueError,
     "'bogus_key'", "paddle_hsdp's keys: fsdp_outer_degree", "tensor_fusion")
def _sharding_configs_unknown():
    _strategy_with({"bogus_key": 1})


@row("fleet.init: `sharding_configs['fsdp_outer_sharding']`", '"zero3"', ValueError,
     "fsdp_outer_sharding", "'none'", "'optim'")
def _outer_sharding_value():
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"sharding_degree": 4, "sharding_configs": {
        "fsdp_outer_degree": 2, "fsdp_outer_sharding": "zero3"}}
    fleet_ext.validate_strategy(strategy)


# ---------------------------------------------------------------- fully_shard
@row("`fully_shard(module)`", "a list of layers", TypeError, "paddle.nn.Layer")
def _shard_not_a_layer():
    paddle_hsdp.fully_shard([_net()])


@row("`fully_shard(module)`", "called twice on one module", ValueError,
     "already applied", "once per module")
def _shard_twice(model):
    paddle_hsdp.fully_shard(model)


@row("`fully_shard(module)`", "on a child after its parent", ValueError,
     "bottom-up", "children first")
def _shard_child_after_parent(model):
    paddle_hsdp.fully_shard(model[2])


@row("`fully_shard(module)`", "a module with no parameters (`nn.ReLU()`)", ValueError,
     "no parameters")
def _shard_no_params():
    paddle_hsdp.fully_shard(paddle.nn.ReLU())


@row("`fully_shard(module)`", "a zero-size parameter (shape `[0, 4]`)", ValueError,
     "zero-size", "ignored_params")
def _shard_zero_size():
    model = _net()
    model.add_parameter("empty", paddle.create_parameter([0, 4], "float32"))
    paddle_hsdp.fully_shard(model)


@row("`fully_shard(reshard_after_forward=)`", '"True" (a string)', TypeError,
     "reshard_after_forward", "None, True or False")
def _shard_reshard_type():
    paddle_hsdp.fully_shard(_net(), reshard_after_forward="True")


@row("`fully_shard(reshard_after_forward=)`", "2 (an int: torch's partial reshard)",
     NotImplementedError, "reshard_after_forward")
def _shard_reshard_int():
    paddle_hsdp.fully_shard(_net(), reshard_after_forward=2)


@row("`fully_shard(mp_policy=)`", '"bf16" (not a policy)', TypeError, "mp_policy",
     "MixedPrecisionPolicy")
def _shard_mp_policy():
    paddle_hsdp.fully_shard(_net(), mp_policy="bf16")


@row("`MixedPrecisionPolicy(param_dtype=)`", '"int32"', ValueError, "param_dtype",
     "float16", "bfloat16")
def _policy_dtype():
    paddle_hsdp.MixedPrecisionPolicy(param_dtype="int32")


@row("`OuterSyncPolicy(every=)`", "0", ValueError, "every", ">= 1")
def _outer_sync_every():
    paddle_hsdp.OuterSyncPolicy(every=0)


@row("`OuterSyncPolicy(momentum=)`", "1.0", ValueError, "momentum", "[0, 1)")
def _outer_sync_momentum():
    paddle_hsdp.OuterSyncPolicy(every=4, momentum=1.0)


@row("`OuterSyncPolicy(fragments=)`", "5 with `every=4`", ValueError, "fragments",
     "from 1 to every (4")
def _outer_sync_fragments():
    paddle_hsdp.OuterSyncPolicy(every=4, fragments=5)


@row("`fully_shard(outer_sync_policy=)`", "4 (not a policy)", TypeError,
     "outer_sync_policy", "OuterSyncPolicy")
def _shard_outer_sync_type():
    paddle_hsdp.fully_shard(_net(), outer_sync_policy=4)


@row("`fully_shard(outer_sync_policy=)`", "`every=4` with `fsdp_outer_sharding=\"optim\"`",
     NotImplementedError, "fsdp_outer_sync_every", "fsdp_outer_sharding='optim'")
def _shard_outer_sync_hfsdp():
    paddle_hsdp.fully_shard(_net(), outer_sync_policy=paddle_hsdp.OuterSyncPolicy(every=4),
                            fsdp_outer_sharding="optim")


@row("`fully_shard(offload_policy=)`", "True (not a policy)", TypeError, "offload_policy",
     "CPUOffloadPolicy")
def _shard_offload():
    paddle_hsdp.fully_shard(_net(), offload_policy=True)


@row("`fully_shard(ignored_params=)`", "3", TypeError, "ignored_params")
def _shard_ignored():
    paddle_hsdp.fully_shard(_net(), ignored_params=3)


@row("`fully_shard(mesh=)`", "`[0, 1]` (a list)", TypeError, "mesh", "ProcessMesh")
def _shard_mesh():
    from paddle_hsdp.topology import mesh  # what fully_shard resolves its mesh with (faked here)

    mesh.resolve_mesh([0, 1])


@row("`fully_shard(enable_tensor_fusion_and_overlap=)`", '"yes"', TypeError,
     "enable_tensor_fusion_and_overlap", "True or False")
def _shard_overlap():
    paddle_hsdp.fully_shard(_net(), enable_tensor_fusion_and_overlap="yes")


@row("`fully_shard(sync_module_states=)`", '"no"', TypeError,
     "sync_module_states", "True or False")
def _shard_sync():
    paddle_hsdp.fully_shard(_net(), sync_module_states="no")


@row("`fully_shard(fsdp_outer_sharding=)`", '"optimizer"', ValueError,
     "fsdp_outer_sharding", "'none' or 'optim'")
def _shard_outer_sharding():
    paddle_hsdp.fully_shard(_net(), fsdp_outer_sharding="optimizer")


@row("`fully_shard(module)` before `fleet.init`", "no fleet groups, no `mesh=`", RuntimeError,
     "fleet.init", "mesh=paddle.distributed.ProcessMesh")
def _shard_before_fleet():
    from paddle_hsdp.topology import mesh  # what fully_shard resolves its groups with (faked here)

    mesh.resolve_mesh(None)


# ---------------------------------------------------------------- module methods
@row("`model.set_prefetch_count(forward=)`", "-1", ValueError, "forward", ">= 0")
def _prefetch(model):
    model.set_prefetch_count(forward=-1)


@row("`model.set_requires_gradient_sync()`", '"no"', TypeError,
     "set_requires_gradient_sync", "True or False")
def _grad_sync(model):
    model.set_requires_gradient_sync("no")


@row("`model.set_gradient_divide_factor()`", "0", ValueError, "finite", "> 0")
def _divide_factor(model):
    model.set_gradient_divide_factor(0)


@row("`model.set_modules_to_forward_prefetch()`", "a module that is not sharded",
     ValueError, "not an FSDP module", "fully_shard")
def _prefetch_modules(model):
    model.set_modules_to_forward_prefetch([paddle.nn.ReLU()])


@row("`paddle_hsdp.set_zero_stage(model, stage)`", "4", ValueError, "stage", "[1, 2, 3]")
def _zero_stage(model):
    paddle_hsdp.set_zero_stage(model, 4)


@row("`paddle_hsdp.set_zero_stage(model, stage)`", "a model without `fully_shard`",
     ValueError, "fully_shard")
def _zero_stage_plain():
    paddle_hsdp.set_zero_stage(_net(), 3)


@row("`paddle_hsdp.mark_expert_params(layer)`", "after `fully_shard`", RuntimeError,
     "before fully_shard")
def _experts_late():
    paddle_hsdp.mark_expert_params(_sharded())


@row("`paddle_hsdp.mark_expert_params(global_indices=)`", "`[1, 1]`", ValueError,
     "global_indices", "distinct non-negative")
def _experts_indices():
    experts = paddle.nn.LayerList([paddle.nn.Linear(2, 2), paddle.nn.Linear(2, 2)])
    paddle_hsdp.mark_expert_params(experts, global_indices=[1, 1])


@row("`paddle_hsdp.check_collectives(enabled)`", '"yes"', TypeError, "check_collectives",
     "True or False")
def _check_collectives():
    paddle_hsdp.check_collectives("yes")


# ---------------------------------------------------------------- config keys
@row("`apply_config(model, config)`", "`{sharding_sise: 2}` (a typo)", paddle_hsdp.ConfigError,
     "sharding_sise", "did you mean 'sharding_size'")
def _config_unknown():
    paddle_hsdp.apply_config(_Lm(), {"sharding_sise": 2})


@row("`apply_config(model, config)`", "`{zero_stage: 4}`", paddle_hsdp.ConfigError,
     "zero_stage", "1, 2, 3")
def _config_value():
    paddle_hsdp.apply_config(_Lm(), {"zero_stage": 4})


@row("`apply_config(model, config)`", "`{fsdp_outer_sharding: os}`", paddle_hsdp.ConfigError,
     "fsdp_outer_sharding", "'auto', 'none' or 'optim'")
def _config_outer_sharding():
    paddle_hsdp.apply_config(_Lm(), {"fsdp_outer_sharding": "os"})


@row("`apply_config(model, config)`", "`{sub_modules_to_wrap: ['layers.{5-2}']}`",
     paddle_hsdp.ConfigError, "sub_modules_to_wrap", "5-2")
def _config_range():
    paddle_hsdp.apply_config(_Lm(), {"sub_modules_to_wrap": ["layers.{5-2}"]})


@row("`apply_config(model, config)`", "`{sub_modules_to_wrap: ['layer.{*}']}` (no match)",
     ValueError, "matches no sub-module", "layers")
def _config_no_match():
    paddle_hsdp.apply_config(_Lm(), {"sub_modules_to_wrap": ["layer.{*}"]})


@row("`apply_config(model, config)`",
     "`{sub_modules_to_wrap: ['layers.{0-5}']}` on 2 layers (partly past the model)",
     ValueError, "names indices 2-5", "indices present there: 0-1")
def _config_partly_past():
    paddle_hsdp.apply_config(_Lm(), {"sub_modules_to_wrap": ["layers.{0-5}"]})


@row("`apply_config(model, config)`", "`{fsdp_outer_degree: 3}` on one rank",
     paddle_hsdp.ConfigError, "fsdp_outer_degree", "world size")
def _config_degree():
    paddle_hsdp.apply_config(_Lm(), {"fsdp_outer_degree": 3})


@row("`paddle.jit.to_static(model)`", "a model sharded by `fully_shard`",
     NotImplementedError, "to_static", "not supported", "full_state_dict")
def _to_static(model):
    paddle.jit.to_static(model)


@row("`full_state_dict(model)`", "an optimizer", TypeError, "full_state_dict",
     "paddle.nn.Layer", "AdamW")
def _full_state_dict_of_optimizer(model):
    paddle_hsdp.full_state_dict(paddle.optimizer.AdamW(parameters=model.parameters()))


@row("`save_checkpoint(path, model, optimizer)`", "the model as the optimizer", TypeError,
     "save_checkpoint(path, model, optimizer)", "paddle.optimizer.Optimizer")
def _save_model_as_optimizer(tmp_path, model):
    paddle_hsdp.save_checkpoint(tmp_path / "ck", model, model)


@row("`last_global_norm(optimizer)`", "a model", TypeError, "last_global_norm",
     "paddle.optimizer.Optimizer")
def _norm_of_model(model):
    paddle_hsdp.last_global_norm(model)


# ---------------------------------------------------------------- checkpoints
@row("`load_checkpoint(path, model)`", "a directory that is not a checkpoint",
     checkpoint.CheckpointError, "not a checkpoint")
def _load_missing(tmp_path, net):
    paddle_hsdp.load_checkpoint(tmp_path, net)


@row("`load_checkpoint(path, model)`", "another model's checkpoint",
     checkpoint.CheckpointError, "does not match this model", "strict=False")
def _load_other(tmp_path, net):
    paddle_hsdp.save_checkpoint(tmp_path / "ck", paddle.nn.Linear(3, 3))
    paddle_hsdp.load_checkpoint(tmp_path / "ck", net)


def _replica(model, optimizer, step=0):
    """A fault-tolerant replica as ``load_checkpoint`` sees it (no fleet, no etcd)."""
    from paddle_hsdp.ft.replica import Replica
    ft = object.__new__(Replica)
    ft.model, ft.optimizer, ft.step, ft.round, ft.history = model, optimizer, step, None, []
    ft.rank, ft.ranks_per_replica = 0, 1
    return ft


@row("`replica.load_checkpoint(path)` (ft)", "a checkpoint saved outside a fault-tolerant job",
     checkpoint.CheckpointError, "no fault-tolerant job's resume state",
     "paddle_hsdp.load_checkpoint")
def _resume_plain(tmp_path, net):
    opt = paddle.optimizer.AdamW(parameters=net.parameters())
    paddle_hsdp.save_checkpoint(tmp_path / "ck", net, opt)
    _replica(net, opt).load_checkpoint(tmp_path / "ck")


@row("`replica.load_checkpoint(path)` (ft)", "after the first `train_step`", RuntimeError,
     "load_checkpoint", "before the first train_step")
def _resume_late(tmp_path, net):
    _replica(net, paddle.optimizer.AdamW(parameters=net.parameters()), step=1) \
        .load_checkpoint(tmp_path)


@row("`save_checkpoint(path, model, extra=)`", "`{'rng': object()}` (not JSON)", TypeError,
     "JSON serializable")
def _save_extra(tmp_path):
    paddle_hsdp.save_checkpoint(tmp_path / "ck", _net(), extra={"rng": object()})


@row("`save_checkpoint(path, model)`", "a directory that is not a checkpoint (`notes.txt`)",
     checkpoint.CheckpointError, "is not a paddle_hsdp-checkpoint/4 checkpoint", "notes.txt",
     "nothing was written")
def _save_onto_foreign_directory(tmp_path, net):
    (tmp_path / "notes.txt").write_text("mine")
    try:
        paddle_hsdp.save_checkpoint(tmp_path, net)
    finally:
        assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- the commands
class _Exit(Exception):
    pass


def _command(argv):
    if cli(argv) != 1:
        raise AssertionError(f"{argv} did not exit 1")
    raise _Exit("exit status 1")


@row("`python -m paddle_hsdp check-config FILE`", "a missing file", _Exit, "exit status 1")
def _cli_check(tmp_path):
    _command(["check-config", str(tmp_path / "missing.yaml")])


@row("`python -m paddle_hsdp plan --model`", "`no_such_module:factory`", _Exit,
     "exit status 1")
def _cli_plan(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("zero_stage: 3\n")
    _command(["plan", "--config", str(config), "--model", "no_such_module:factory",
              "--world-size", "2"])


@row("`python -m paddle_hsdp.checkpoint consolidate CKPT OUT`", "OUT named "
     "`model.safetensors` (a name `from_pretrained` loads as Hugging Face layout)", _Exit,
     "exit status 1")
def _cli_consolidate_as_model_safetensors(tmp_path):
    checkpoint.save_checkpoint(tmp_path / "ck", _net())
    if checkpoint.main(["consolidate", str(tmp_path / "ck"),
                        str(tmp_path / "model.safetensors")]) != 1:
        raise AssertionError("consolidate into model.safetensors did not exit 1")
    assert not (tmp_path / "model.safetensors").exists()
    raise _Exit("exit status 1")


class _Pretrained(paddle.nn.Sequential):
    """A model class with PaddleFormers' ``save_pretrained`` entry point."""

    def save_pretrained(self, save_dir, **kwargs):
        raise AssertionError("the sharded model's own save_pretrained ran")


@row("`model.save_pretrained(dir)`", "a PaddleFormers model sharded by `fully_shard`, on "
     "every rank or rank 0 alone", NotImplementedError, "save_pretrained",
     "export_pretrained(model, dir) on every rank", "Nothing was written")
def _save_pretrained_of_sharded(tmp_path):
    model = _Pretrained(paddle.nn.Linear(4, 6), paddle.nn.Linear(6, 2))
    paddle_hsdp.fully_shard(model)
    model.save_pretrained(str(tmp_path / "out"))


@row("`export_pretrained(model, dir)`", "a model with expert parameters under expert "
     "parallelism (ep_degree 2)", NotImplementedError, "export_pretrained", "ep_degree 1",
     "save_checkpoint", "consolidate", "Nothing was written")
def _export_of_expert_parallel(tmp_path, monkeypatch):
    from paddle.distributed.fleet.base import topology as fleet_topology

    from paddle_hsdp.integrations.paddleformers import export_pretrained

    model = _Pretrained(paddle.nn.Linear(4, 6), paddle.nn.Linear(6, 2))
    paddle_hsdp.mark_expert_params(model[1])
    monkeypatch.setattr(fleet_topology, "_HYBRID_PARALLEL_GROUP", FakeHCG(ep=2))
    export_pretrained(model, str(tmp_path / "out"))


@row("`save_checkpoint(path, model)`", "under tensor parallelism, a parameter marked "
     "`is_distributed` without `split_axis`", NotImplementedError, "is_distributed",
     "split_axis", "Give it split_axis")
def _save_split_without_axis(tmp_path, monkeypatch):
    from paddle.distributed.fleet.base import topology as fleet_topology

    model = paddle.nn.Linear(4, 6)
    model.weight.is_distributed = True
    monkeypatch.setattr(fleet_topology, "_HYBRID_PARALLEL_GROUP", FakeHCG(mp=2))
    paddle_hsdp.save_checkpoint(tmp_path / "ck", model)


@row("`python -m paddle_hsdp.checkpoint inspect CKPT`", "a missing checkpoint", _Exit,
     "exit status 1")
def _cli_inspect(tmp_path):
    if checkpoint.main(["inspect", str(tmp_path / "missing")]) != 1:
        raise AssertionError("inspect of a missing checkpoint did not exit 1")
    raise _Exit("exit status 1")


# ---------------------------------------------------------------- environment
@row("`PADDLE_HSDP_COLLECTIVE_TIMEOUT`", '"soon"', ValueError,
     "PADDLE_HSDP_COLLECTIVE_TIMEOUT", "seconds")
def _env_timeout(monkeypatch):
    from paddle_hsdp.comm import watchdog

    monkeypatch.setenv("PADDLE_HSDP_COLLECTIVE_TIMEOUT", "soon")
    watchdog.timeout_s()


# ---------------------------------------------------------------- accepted edge cases
def test_integer_parameters_are_sharded_and_gathered(fake_mesh):  # noqa: F811
    """An integer (frozen) parameter is not bad input: it gets a buffer of its own, is
    gathered exactly, and training around it works."""
    model = _net()
    model.add_parameter("index", paddle.create_parameter(
        [5, 3], "int64", default_initializer=paddle.nn.initializer.Constant(7)))
    model.index.stop_gradient = True
    paddle_hsdp.fully_shard(model)
    kinds = sorted(str(b.dtype) for b in model._hsdp_unit.buffers)
    assert kinds == ["paddle.float32", "paddle.int64"], kinds
    assert (paddle_hsdp.full_state_dict(model)["index"].numpy() == 7).all()
    _still_trains(model)


# ---------------------------------------------------------------- the checks
def _still_trains(model) -> None:
    """A forward, a backward and an optimizer step run after the refused call."""
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    out = model(paddle.ones([2, 4]))
    out.sum().backward()
    opt.step()
    opt.clear_grad()


def _arguments(r: Row, tmp_path, monkeypatch) -> dict:
    """What a row's function asks for by name: ``model`` (a sharded model) or ``net`` (a
    plain one), which must still train after the refused call; pytest's fixtures."""
    import inspect

    made = {"model": _sharded, "net": _net, "tmp_path": lambda: tmp_path,
            "monkeypatch": lambda: monkeypatch}
    return {name: made[name]() for name in inspect.signature(r.run).parameters}


@pytest.mark.parametrize("r", ROWS, ids=[f"{i:02d}" for i in range(len(ROWS))])
def test_bad_input_is_refused_clearly(r, fake_mesh, tmp_path, monkeypatch):  # noqa: F811
    kwargs = _arguments(r, tmp_path, monkeypatch)
    with pytest.raises(r.error) as caught:
        r.run(**kwargs)
    message = str(caught.value)
    missing = [s for s in r.says if s not in message]
    assert not missing, f"{r.entry} / {r.bad}: message lacks {missing}: {message}"
    for name in ("model", "net"):
        if name in kwargs:
            _still_trains(kwargs[name])


MULTI_RANK = [
    ("a unit run on some ranks only", "`CollectiveMismatchError` on every rank of the group "
     "(all-gather tags)", "test_recipes.py"),
    ("collectives of different sizes or dtypes across ranks",
     "`CollectiveMismatchError` before the collective, with "
     "`PADDLE_HSDP_CHECK_COLLECTIVES=1`", "test_faults.py"),
    ("a rank that dies or hangs", "`CollectiveError` / watchdog exit 124 naming the op "
     "and group, within `PADDLE_HSDP_COLLECTIVE_TIMEOUT`", "test_faults.py"),
    ("a config that disagrees with the live fleet topology", "`ConfigError` on every rank",
     "test_config_driven.py"),
    ("a typo in `sharding_configs`", "`ValueError` on every rank before any group exists",
     "test_comm_ops.py"),
    ("`set_requires_all_reduce(False)` at the optimizer step with "
     "`fsdp_outer_sharding=\"optim\"` (replicas hold 1/O of the optimizer state each)",
     "`NotImplementedError` on every rank before any collective", "test_hfsdp.py"),
    ("`set_requires_all_reduce(False)` at the optimizer step with a grad clip: each "
     "replica clips by its own norm (2026-12-07; it was replica 0's for all)",
     "the replicas' own norms; with tensor, pipeline or sep parallelism or experts "
     "`NotImplementedError` before any update", "test_diloco.py"),
    ("`state_dict()`, `full_state_dict`, `full_grads`, `save_checkpoint` or "
     "`load_checkpoint` called on some ranks only", "`CollectiveMismatchError` on the "
     "callers, naming the call and how many ranks came, within "
     "`PADDLE_HSDP_COLLECTIVE_TIMEOUT`, before any collective", "test_faults.py"),
    ("a `HSDPTrainingArguments` PaddleFormers cannot train with (its own `sharding`, "
     "TP / PP / EP degrees, `fp16`, rank-0-only checkpoint formats)",
     "`ConfigError` naming the argument on every rank before any group exists",
     "test_trainer.py"),
    ("a `PipelineLayer` built without fleet's `topology` (its stages are not fleet's)",
     "`ValueError` naming `topology` on every rank, before any collective", "test_3d.py"),
    ("`fully_shard(..., sync_module_states=False)` on weights that differ between the "
     "ranks of an FSDP group", "`ReplicaMismatchError` on every rank, naming the first "
     "tensor that differs and the ranks that hold other values, before anything changes",
     "test_agreement.py"),
]


def readme_table() -> str:
    lines = ["| entry point | bad input | error | the message says |",
             "| --- | --- | --- | --- |"]
    for r in ROWS:
        error = "exit status 1" if r.error is _Exit else f"`{r.error.__name__}`"
        says = "; ".join(s for s in r.says if s != "exit status 1") or "the errors, one per line"
        lines.append(f"| {r.entry} | {r.bad} | {error} | {says} |")
    for what, error, where in MULTI_RANK:
        lines.append(f"| several ranks | {what} | {error} | `test_collective/{where}` |")
    return "\n".join(lines)


def test_readme_table_is_generated_from_these_rows():
    with open(os.path.join(ROOT, "docs", "faults.md")) as f:
        faults = f.read()
    table = readme_table()
    assert table in faults, ("docs/faults.md's bad-input table is out of date; regenerate it with "
                             "PYTHONPATH=test python -c 'import test_bad_input as t; "
                             "print(t.readme_table())'")
    assert len(re.findall(r"^\| ", table, re.M)) == len(ROWS) + len(MULTI_RANK) + 2


def test_to_static_still_converts_a_model_that_is_not_sharded():
    """The refusal is for sharded models only: a plain layer converts as before."""
    net = _net()
    x = paddle.randn([3, 4])
    expected = net(x).numpy()
    static = paddle.jit.to_static(net)
    assert (static(x).numpy() == expected).all()
