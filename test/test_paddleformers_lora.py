"""A LoRA model under HSDP in one process (issue 67): its adapters saved in
PaddleFormers' own format (what ``LoRAModel.from_pretrained`` loads), its checkpoint
holding the adapters alone, and its merged export (what the base class's
``from_pretrained`` loads, giving the LoRA model's logits). The same on 2 and 4 ranks
through the CLI: test_collective/test_paddleformers_cli.py."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("paddleformers.peft", reason="PaddleFormers is an optional extra: "
                    "pip install paddle_hsdp[paddleformers] (tools/test.sh installs it)")

import paddle  # noqa: E402
from paddleformers.peft import LoRAModel  # noqa: E402
from paddleformers.transformers import LlamaForCausalLM  # noqa: E402

import paddle_hsdp  # noqa: E402
from lora_model import WRAP, base_model, input_ids, lora_model, logits  # noqa: E402
from paddle_hsdp.integrations.paddleformers import (export_pretrained,  # noqa: E402
                                                    save_lora_adapters)


@pytest.fixture
def sharded(registry):
    model = lora_model()
    ids = input_ids()
    want = logits(model, ids)
    trainable = {n: p.numpy().copy() for n, p in model.model.named_parameters()
                 if not p.stop_gradient}
    paddle_hsdp.apply_config(model, {"sub_modules_to_wrap": WRAP})
    return model, ids, want, trainable


def test_adapters_are_written_in_paddleformers_format(sharded, tmp_path):
    model, ids, want, trainable = sharded
    save_lora_adapters(model, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "lora_config.json",
                                            "lora_model_state.pdparams"]
    saved = paddle.load(str(tmp_path / "lora_model_state.pdparams"))
    assert sorted(saved) == sorted(trainable) and len(saved) == 12, sorted(saved)
    for name, value in trainable.items():
        np.testing.assert_array_equal(saved[name].numpy(), value, err_msg=name)
    loaded = LoRAModel.from_pretrained(base_model(), str(tmp_path))
    np.testing.assert_array_equal(logits(loaded, ids), want)


def test_merged_export_loads_with_from_pretrained(sharded, tmp_path):
    model, ids, want, _ = sharded
    export_pretrained(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    merged = LlamaForCausalLM.from_pretrained(str(tmp_path), convert_from_hf=True)
    names = [n for n, _ in merged.named_parameters()]
    assert not any("lora" in n for n in names) and len(names) == 21, names
    # W + A @ B * scaling in float32 instead of x @ W + (x @ A) @ B * scaling
    np.testing.assert_allclose(logits(merged, ids), want, rtol=0, atol=1e-5)


def test_checkpoint_holds_the_adapters_alone_and_resumes_them(sharded, tmp_path):
    model, ids, want, trainable = sharded
    full, adapters = str(tmp_path / "full"), str(tmp_path / "adapters")
    paddle_hsdp.save_checkpoint(full, model)
    paddle_hsdp.save_checkpoint(adapters, model, trainable_only=True)
    with open(os.path.join(adapters, "metadata.json")) as f:
        names = sorted(json.load(f)["tensors"])
    assert names == sorted(f"model.{n}" for n in trainable), names

    def size(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    # 1,664 adapter floats (6.5 kB) against the base's 25,376: 11.2 kB with the
    # metadata against 109 kB, measured
    adapter_bytes = 4 * sum(v.size for v in trainable.values())
    assert size(adapters) < adapter_bytes + 6000 < size(full) / 8, (size(adapters), size(full))
    other = lora_model(seed=7)  # the same base, other adapters
    for name, p in other.named_parameters():
        if "lora_A" in name:
            p.set_value(paddle.zeros_like(p))
    paddle_hsdp.apply_config(other, {"sub_modules_to_wrap": WRAP})
    paddle_hsdp.load_checkpoint(adapters, other, trainable_only=True)
    np.testing.assert_array_equal(logits(other, ids), want)
