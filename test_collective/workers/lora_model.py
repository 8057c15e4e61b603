"""The LoRA tests' model (issue 67): a tiny untied Llama in float32 (seed 7) under
PaddleFormers' ``LoRAModel`` on q, v and gate projections (rank 4), its ``lora_B`` set
non-zero (as after training: it starts at zero) so the adapters change the logits."""

from __future__ import annotations

import numpy as np
import paddle
from paddleformers.peft import LoRAConfig, LoRAModel
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

TARGETS = [".*q_proj.*", ".*v_proj.*", ".*gate_proj.*"]
WRAP = ["model.model.layers.{*}"]  # the decoder blocks, under LoRAModel's .model


def base_model(seed: int = 7) -> LlamaForCausalLM:
    paddle.set_default_dtype("float32")
    paddle.seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=False,
                         fuse_rms_norm=False)
    return LlamaForCausalLM(config)


def lora_model(seed: int = 7) -> LoRAModel:
    model = LoRAModel(base_model(seed), LoRAConfig(target_modules=TARGETS, r=4, lora_alpha=8,
                                                   merge_weights=False))
    paddle.seed(11)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.set_value(paddle.randn(p.shape, dtype=p.dtype) * 0.1)
    return model


def input_ids() -> paddle.Tensor:
    return paddle.to_tensor(np.random.RandomState(0).randint(0, 64, (2, 8)).astype("int64"))


def logits(model: paddle.nn.Layer, ids: paddle.Tensor) -> np.ndarray:
    model.eval()
    with paddle.no_grad():
        out = model(input_ids=ids)
    return (out[0] if isinstance(out, (tuple, list)) else out.logits).numpy()
