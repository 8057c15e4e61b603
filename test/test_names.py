"""Issue 64, item 4: every refusal or warning about a parameter names it by its path
from the model root (``blocks.1.fc1.weight``, as ``named_parameters()`` gives it), never
by its name inside its unit (``fc1.weight``, which every block's parameter shares).

Walked on TinyLM, whose three blocks repeat their parameter names, sharded as the
workers shard it (the embedding, each block, the root), plus a static check that no
message in the package formats a unit-relative name."""

import os
import re

import numpy as np
import paddle
import pytest
from paddle.amp.auto_cast import amp_initialize

from kit import batch_ids, models, shard_tinylm
from paddle_hsdp.engine.registry import param_path, registry as hsdp_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sharded():
    return shard_tinylm(models.build_model())


def test_param_path_is_the_models_name(fake_mesh):
    model = _sharded()
    named = {id(p): n for n, p in model.named_parameters()}
    for unit in hsdp_registry.units_under(model):
        for sp in unit.params:
            assert param_path(sp) == named[id(sp.shard)], (sp.fqn, named[id(sp.shard)])
    block1 = hsdp_registry.units_under(model.blocks[1])[0]
    assert "(blocks.1.extra, ...)" in block1.buffers[0].describe()


def test_stop_gradient_flipped_after_sharding_names_the_models_path(fake_mesh):
    model = _sharded()
    model.blocks[1].fc1.weight.stop_gradient = True
    with pytest.raises(RuntimeError, match=r"^blocks\.1\.fc1\.weight: stop_gradient"):
        models.lm_loss(model, batch_ids(), True)


def test_a_shard_cast_after_sharding_names_the_models_path(fake_mesh):
    model = _sharded()
    amp_initialize(models=[model], dtype="bfloat16", excluded_layers=None)
    with pytest.raises(NotImplementedError, match=r"^embed\.weight: its HSDP shard was cast"):
        models.lm_loss(model, batch_ids(), True)


def test_optimizer_state_refusal_names_the_models_path(fake_mesh):
    model = _sharded()
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    models.lm_loss(model, batch_ids(), True).backward()
    opt.step()
    state = opt.state_dict()
    shard = model.blocks[2].fc2.weight
    key = next(k for k in state if k.startswith(shard.name + "_moment1"))
    with pytest.raises(ValueError, match=r"'blocks\.2\.fc2\.weight'"):
        opt.set_state_dict(dict(state, **{key: paddle.zeros([2, 2], state[key].dtype)}))
    assert np.isfinite(state[key].numpy()).all()


def test_no_message_formats_a_unit_relative_name():
    """``sp.fqn`` (a ShardedParam's name inside its unit) appears in no f-string of
    the package but registry.param_path's own."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "paddle_hsdp")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            text = open(path, encoding="utf-8").read()
            for m in re.finditer(r"\{[^{}]*\.fqn[^{}]*\}", text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{os.path.relpath(path, ROOT)}:{line}: {m.group(0)}")
    allowed = {"paddle_hsdp/engine/registry.py"}
    assert [f for f in found if f.split(":")[0] not in allowed] == []
