"""``apply_config`` and the ``check-config`` / ``plan`` commands in one process: what
a config makes of a model (units bottom-up, recompute, experts, dtypes, prefetch,
ZeRO level), that the plan's buffers are the engine's, and that every bad config is
refused before anything changes. Numerics on real ranks: test_collective/test_config_driven.py."""

import dataclasses
import os
import subprocess
import sys

import paddle
import pytest
from paddle import nn

import paddle_hsdp
from paddle_hsdp import ConfigError
from paddle_hsdp.__main__ import main as cli
from paddle_hsdp.config import apply
from paddle_hsdp.config import plan as plan_module
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.config.patterns import PatternError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 9)
        self.fc2 = nn.Linear(9, 4)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class Experts(nn.Layer):
    def __init__(self):
        super().__init__()
        self.experts = nn.LayerList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        return sum(e(x) for e in self.experts)


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.stop_gradient = True
        self.frozen.bias.stop_gradient = True
        self.layers = nn.LayerList([Block() for _ in range(3)])
        self.moe = Experts()
        self.head = nn.Linear(4, 11)

    def forward(self, ids):
        x = self.frozen(self.embed(ids))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.moe(x))


def build():
    paddle.seed(1)
    return Net()


CONFIG = {
    "sub_modules_to_wrap": ["Block", "moe"],
    "ignored_modules": ["frozen"],
    "recompute_modules": ["layers.{0,2}"],
    "expert_modules": ["moe.experts"],
    "param_dtype": "bf16", "reduce_dtype": "fp32",
    "num_to_forward_prefetch": 2, "num_to_backward_prefetch": 0,
    "zero_stage": 2,
}


@pytest.fixture
def no_fleet_init(monkeypatch):
    calls = []
    monkeypatch.setattr(apply, "init_fleet_if_needed", lambda *a: calls.append(a))
    return calls


def test_apply_config_shards_as_the_config_says(fake_mesh, no_fleet_init):  # noqa: F811
    model, plan = paddle_hsdp.apply_config(build(), CONFIG)
    assert no_fleet_init == [(1, 1, "none")]  # one process: a 1 x 1 layout, HSDP
    units = hsdp_registry.units_under(model)
    assert [u.path() for u in units] == ["layers.0", "layers.1", "layers.2", "moe", "<root>"]
    assert [u.path for u in plan.units] == [u.path() for u in units]
    assert [getattr(m, "_hsdp_recompute", False) for m in model.layers] == [True, False, True]
    assert all(p.is_moe_param for p in model.moe.experts.parameters())
    assert not any(hsdp_registry.managed_param(p) for p in model.frozen.parameters())
    for unit in units:
        assert (unit.controls.forward_prefetch_count, unit.controls.backward_prefetch_count) == (2, 0)
        assert unit.controls.reshard_after_forward is False  # zero_stage 2
        assert str(unit.policies.mp.param_dtype).endswith("bf16") or \
            unit.policies.mp.param_dtype in ("bfloat16", paddle.bfloat16)
    # the plan's buffers are the engine's, size for size (labels aside)
    for planned, live in zip(plan.units, units):
        strip = lambda b: dataclasses.replace(b, inner_label="", outer_label="")  # noqa: E731
        assert [strip(b) for b in planned.buffers] == [strip(b) for b in live.shape().buffers]
        assert planned.reshard_after_forward == live.should_reshard_after_forward()
    assert "layers.0" in str(plan) and "inner all_gather" in str(plan)
    loss = model(paddle.to_tensor([[1, 2, 3]])).mean()
    loss.backward()  # recompute inside sharded units runs


@pytest.mark.parametrize("config,match", [
    ({"sub_modules_to_wrap": ["layers.{*}"], "ignored_modules": ["layers.1"]},
     "'layers.1' is also ignored"),
    ({"sub_modules_to_wrap": ["layers.{0-1}.fc1"], "ignored_modules": ["layers"]},
     "is also ignored"),
    ({"sub_modules_to_wrap": ["layer.{*}"]}, "nearest paths: 'layers"),
    ({"recompute_modules": ["DecoderLayer"]}, "no sub-module has class 'DecoderLayer'"),
    ({"fsdp_outer_degree": 2}, "fsdp_outer_degree"),
    ({"sharding_size": 4}, "sharding_size"),
    ({"zero_stage": 4}, "zero_stage"),
    ({"sub_modules_to_wrapp": ["Block"]}, "did you mean 'sub_modules_to_wrap'"),
])
def test_bad_configs_change_nothing(fake_mesh, no_fleet_init, config, match):  # noqa: F811
    model = build()
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    with pytest.raises((ConfigError, PatternError), match=match):
        paddle_hsdp.apply_config(model, config)
    assert not hsdp_registry.units and not no_fleet_init
    assert not any(getattr(m, "_hsdp_recompute", False) for m in model.sublayers())
    assert not any(getattr(p, "is_moe_param", False) for p in model.parameters())
    assert all((p.numpy() == before[n]).all() for n, p in model.named_parameters())


def test_apply_config_takes_a_yaml_file(tmp_path, fake_mesh, no_fleet_init):  # noqa: F811
    path = tmp_path / "c.yaml"
    path.write_text("sub_modules_to_wrap: ['layers.{*}']\nzero_stage: 3\n")
    model, plan = paddle_hsdp.apply_config(build(), str(path))
    assert len(plan.units) == 4 and plan.source == str(path)
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        paddle_hsdp.apply_config("not a model", str(path))


# ---------------------------------------------------------------- the commands
def test_check_config_command(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("sharding_size: auto\nsub_modules_to_wrap: ['layers.{*}']\n")
    bad.write_text("sharding_size: 0\nprefetch: 2\nsub_modules_to_wrap: ['x.{5-2}']\n")
    assert cli(["check-config", str(good)]) == 0
    assert cli(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "sharding_size" in err and "prefetch: unknown key" in err and "{5-2}" in err
    assert "Traceback" not in err


def test_plan_command(capsys):
    factory = f"{os.path.abspath(__file__)}:build"
    assert cli(["plan", "--config", os.path.join(ROOT, "tools/configs/dense_lm.yaml"),
                "--model", os.path.join(ROOT, "tools/demo.py:build_model"),
                "--world-size", "8", "--ranks-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "outer 2 x inner 4" in out and "blocks.2" in out and "outer all_reduce" in out
    assert cli(["plan", "--config", os.path.join(ROOT, "tools/configs/dense_lm.yaml"),
                "--model", factory, "--world-size", "4"]) == 1  # blocks.{*} is not in Net
    assert "matches no sub-module" in capsys.readouterr().err
    assert cli(["plan", "--config", os.path.join(ROOT, "tools/configs/dense_lm.yaml"),
                "--model", "no_such_module:f", "--world-size", "4"]) == 1
    assert "cannot import" in capsys.readouterr().err


def test_commands_run_as_a_module_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_stage: [3]\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "paddle_hsdp", "check-config", str(bad)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "zero_stage" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_gives_the_grads_of_a_plain_forward(fake_mesh, no_fleet_init,  # noqa: F811
                                                      reentrant):
    """Recompute inside sharded units (both of Paddle's implementations) changes no grad."""
    config = {"sub_modules_to_wrap": ["layers.{*}"], "use_reentrant": reentrant}
    plain, _ = paddle_hsdp.apply_config(build(), config)
    recomputed, _ = paddle_hsdp.apply_config(
        build(), dict(config, recompute_modules=["layers.{*}"]))
    assert all(m._hsdp_recompute for m in recomputed.layers)
    ids = paddle.to_tensor([[1, 2, 3], [4, 5, 6]])
    grads = []
    for model in (plain, recomputed):
        model(ids).square().mean().backward()
        paddle_hsdp.finish_grad_sync(model)
        grads.append({k: v.numpy() for k, v in paddle_hsdp.full_grads(model).items()
                      if v is not None})
    assert sorted(grads[0]) == sorted(grads[1]) and len(grads[0]) > 5
    for name in grads[0]:
        assert (grads[0][name] == grads[1][name]).all(), name


def test_owned_matrices_in_a_config(fake_mesh, no_fleet_init, monkeypatch):
    """``owned_matrices: true`` gives every fully_shard call paddle_hsdp.owned_matrices()
    (Muon's matrices whole on one rank), matching structured names too; the plan's
    shard sizes take the owners' layout (never smaller than the flat one)."""
    seen = []
    real = apply.fully_shard
    monkeypatch.setattr(apply, "fully_shard",
                        lambda m, **kw: seen.append(kw.get("shard_placement_fn")) or real(m, **kw))
    model, plan = paddle_hsdp.apply_config(build(), {"sub_modules_to_wrap": ["Block"],
                                                     "owned_matrices": True})
    place = seen[0]
    assert len(seen) == 4 and all(fn is place for fn in seen)
    assert place(model.layers[0].fc1.weight) == paddle_hsdp.Owned()
    assert place(model.layers[0].fc1.bias) is None and place(model.embed.weight) is None
    with pytest.raises(ConfigError, match="owned_matrices"):
        paddle_hsdp.load_config({"owned_matrices": "yes"})
    config = paddle_hsdp.load_config({"sub_modules_to_wrap": ["Block"], "owned_matrices": True})
    flat = dataclasses.replace(config, owned_matrices=False)
    sizes = []
    for c in (config, flat):
        net = build()
        units = plan_module.build_plan(net, c, plan_module.resolve_modules(net, c), outer=1,
                                       inner=4).units
        sizes.append([b.shard_numel for u in units for b in u.buffers])
    assert all(o >= f for o, f in zip(*sizes, strict=True)) and sizes[0] != sizes[1]


@pytest.mark.parametrize("value", [True, False])
def test_sync_module_states_in_a_config(fake_mesh, no_fleet_init, monkeypatch, value):
    """``sync_module_states`` (default true: issue 61) reaches every fully_shard call
    apply_config makes (and so HSDPTrainer's); a non-bool is refused by name."""
    seen = []
    real = apply.fully_shard
    monkeypatch.setattr(apply, "fully_shard",
                        lambda m, **kw: seen.append(kw["sync_module_states"]) or real(m, **kw))
    config = {"sub_modules_to_wrap": ["Block"]}
    if not value:
        config["sync_module_states"] = False
    paddle_hsdp.apply_config(build(), config)
    assert seen == [value] * 4
    with pytest.raises(ConfigError, match="sync_module_states"):
        paddle_hsdp.load_config({"sync_module_states": "no"})
