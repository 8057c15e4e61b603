"""A LoRA model over real shards, HSDP 2 x 2 on 4 CPU ranks (issue 67). argv: JSON
``{"work": folder}``. The model sharded after its logits were taken unsharded (every
rank builds it alike, seed 7); then, on every rank: the sharded model's logits equal;
``save_lora_adapters`` (PaddleFormers' adapter files: only the trainable tensors, each
joined from its shards) and ``export_pretrained`` (the merged model). On rank 0:
``LoRAModel.from_pretrained(base, adapters)`` gives the unsharded logits exactly, and
the merged model's ``from_pretrained`` gives them within the float32 bound (``W + A @
B * s`` instead of ``x @ W + (x @ A) @ B * s``)."""

import json
import os
import sys

import numpy as np
import paddle.distributed as dist

import paddle_hsdp
import parity
from common import finish, init_fleet
from lora_model import WRAP, base_model, input_ids, logits, lora_model
from paddle_hsdp.integrations.paddleformers import export_pretrained, save_lora_adapters
from paddleformers.peft import LoRAModel
from paddleformers.transformers import LlamaForCausalLM

work = json.loads(sys.argv[1])["work"]
init_fleet({"sharding_degree": 4, "outer": 2})
model, ids = lora_model(), input_ids()
want = logits(model, ids)
paddle_hsdp.apply_config(model, {"sub_modules_to_wrap": WRAP, "fsdp_outer_degree": 2})
np.testing.assert_array_equal(logits(model, ids), want)
adapters, merged = os.path.join(work, "lora_adapters"), os.path.join(work, "lora_merged")
save_lora_adapters(model, adapters)
export_pretrained(model, merged)
if dist.get_rank() == 0:
    assert sorted(os.listdir(adapters)) == ["config.json", "lora_config.json",
                                            "lora_model_state.pdparams"], os.listdir(adapters)
    np.testing.assert_array_equal(
        logits(LoRAModel.from_pretrained(base_model(), adapters), ids), want)
    # the adapters alone: over another base they give other logits
    other = logits(LoRAModel.from_pretrained(base_model(seed=3), adapters), ids)
    assert not np.allclose(other, want, atol=1e-3)
    # (the plain loader: flex_checkpoint's would be a collective, here on rank 0 alone)
    merged_logits = logits(LlamaForCausalLM.from_pretrained(
        merged, convert_from_hf=True, load_checkpoint_format=None), ids)
    parity.report("LoRA 2 x 2 merged export vs the LoRA model's logits",
                  {"logits": parity.max_rel(merged_logits, want)})
print("LORA_EXPORT_OK", flush=True)
finish()
