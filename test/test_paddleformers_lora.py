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
from paddleformers.peft import LoRAConfig, LoRAModel  # noqa: E402
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import paddle_hsdp  # noqa: E402
from paddle_hsdp.integrations.paddleformers import (export_pretrained,  # noqa: E402
                                                    save_lora_adapters)

TARGETS = [".*q_proj.*", ".*v_proj.*", ".*gate_proj.*"]


def base_model(seed=7):
    paddle.set_default_dtype("float32")
    paddle.seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=False,
                         fuse_rms_norm=False)
    return LlamaForCausalLM(config)


def lora_model(seed=7):
    model = LoRAModel(base_model(seed), LoRAConfig(target_modules=TARGETS, r=4, lora_alpha=8,
                                                   merge_weights=False))
    # adapters that are not zero (lora_B starts at 0): a trained model's
    paddle.seed(11)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.set_value(paddle.randn(p.shape, dtype=p.dtype) * 0.1)
    return model


def logits(model, ids):
    model.eval()
    with paddle.no_grad():
        out = model(input_ids=ids)
    return (out[0] if isinstance(out, (tuple, list)) else out.logits).numpy()


@pytest.fixture
def sharded(registry):
    model = lora_model()
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 64, (2, 8)).astype("int64"))
    want = logits(model, ids)
    trainable = {n: p.numpy().copy() for n, p in model.model.named_parameters()
                 if not p.stop_gradient}
    paddle_hsdp.apply_config(model, {"sub_modules_to_wrap": ["model.model.layers.{*}"]})
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
    paddle_hsdp.apply_config(other, {"sub_modules_to_wrap": ["model.model.layers.{*}"]})
    paddle_hsdp.load_checkpoint(adapters, other, trainable_only=True)
    np.testing.assert_array_equal(logits(other, ids), want)
