"""A custom_register_path plugin for PaddleFormers' own data-parallel run of a LoRA YAML
on CPU (the reference of test_paddleformers_cli.py), which cannot save its adapters
itself there: with ``save_checkpoint_format: ""`` rank 0 alone enters
``LoRAModel.save_pretrained``, whose barrier waits for the other ranks until gloo's
timeout; with flex_checkpoint its save calls ``.cuda()``. Here rank 0 writes the same
file ``save_pretrained`` would (``lora_model_state.pdparams``: every rank holds the
whole model under data parallelism) and every rank meets at a barrier.

Its DPO does not start on CPU: ``DPOTrainer._wrap_ref_model`` (dpo_trainer.py line 225)
passes the reference model to ``fleet.distributed_model``, which reads the strategy of
a ``fleet.init`` that plain data parallelism (``sharding: ""``) never ran:
``AttributeError: 'Fleet' object has no attribute '_user_defined_strategy'``
(paddle/distributed/fleet/model.py line 87). Here the reference model stays unwrapped:
it takes no grads, so a data-parallel wrapper would only have broadcast the weights
every rank already loaded alike, and its ``amp.decorate`` is a no-op in float32.
Training is PaddleFormers' own, untouched."""

import os

import paddle
import paddle.distributed as dist
from paddleformers.cli.train.dpo import workflow as dpo_workflow
from paddleformers.cli.train.sft import workflow
from paddleformers.peft import LoRAModel
from paddleformers.utils.env import LORA_WEIGHTS_NAME

_SFTTrainer = workflow.SFTTrainer
_DPOTrainer = dpo_workflow.DPOTrainer


class ReferenceSFTTrainer(_SFTTrainer):
    def save_model(self, output_dir=None, *args, **kwargs):
        if not isinstance(self.model, LoRAModel):
            return super().save_model(output_dir, *args, **kwargs)
        output_dir = output_dir or self.args.output_dir
        if dist.get_rank() == 0:
            os.makedirs(output_dir, exist_ok=True)
            paddle.save(self.model.get_trainable_state_dict(),
                        os.path.join(output_dir, LORA_WEIGHTS_NAME))
        dist.barrier()
        return None


if workflow.SFTTrainer is _SFTTrainer:
    workflow.SFTTrainer = ReferenceSFTTrainer


class ReferenceDPOTrainer(_DPOTrainer):
    def _wrap_ref_model(self, model):
        return model


if dpo_workflow.DPOTrainer is _DPOTrainer:
    dpo_workflow.DPOTrainer = ReferenceDPOTrainer
