"""``paddleformers-cli train config.yaml`` with HSDP: the CLI's own workflow, with
:class:`HSDPFinetuningArguments` in place of its ``FinetuningArguments`` and
:class:`HSDPSFTTrainer` / :class:`HSDPDPOTrainer` in place of its ``SFTTrainer`` /
``DPOTrainer``.

:func:`install` makes the swap. Two ways run it: PaddleFormers' own YAML hook,
``custom_register_path: <path of paddle_hsdp/integrations/cli_plugin.py>``, which the
CLI executes before it parses the rest of the YAML (``python -m paddle_hsdp.train
--plugin-path`` prints the path); or ``python -m paddle_hsdp.train config.yaml``
(paddle_hsdp/train.py), which installs it and runs the CLI's training function.

What it changes, and nothing else:

* the CLI's argument parser builds ``HSDPFinetuningArguments`` (the CLI's
  ``FinetuningArguments`` plus HSDP's keys: ``fsdp_outer_degree``,
  ``fsdp_outer_sharding``, ``hsdp_config``, ``hsdp_wrap_modules``, ``hsdp_checkpoint``,
  ``hsdp_async_save``); PaddleFormers' ``sharding: stageN [offload]`` and
  ``sharding_parallel_size`` map onto HSDP's (docs/paddleformers.md);
* the SFT / PT workflow's trainer is ``HSDPSFTTrainer`` (``HSDPTrainer`` over the CLI's
  ``SFTTrainer``): the model, LoRA included, sharded before the optimizer is built;
* the DPO workflow's trainer is ``HSDPDPOTrainer`` (``HSDPTrainer`` over the CLI's
  ``DPOTrainer``): the policy sharded so, and the reference model of full fine-tuning
  sharded like it (with LoRA the reference is the policy with its adapters off);
* on a build without CUDA, the workflows' ``from_pretrained`` calls (the model's, and
  ``LoRAModel``'s for ``lora_path``) take the plain loader where they would take
  flex_checkpoint's, whose reshard calls ``.cuda()``.

A stage other than SFT, PT or DPO (the VL stages, the pretraining recipes) is refused
with a ``ConfigError`` naming ``stage`` while the YAML is parsed, before any process
group exists. So are a ``compute_type`` other than ``bf16`` or ``float32`` and DPO's
``ref_model_update_steps`` (a copy of the policy's state into the reference model).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import paddle
from paddleformers.cli.hparams.finetuning_args import FinetuningArguments
from paddleformers.cli.train.dpo import workflow as dpo_workflow
from paddleformers.cli.train.dpo.dpo_trainer import DPOTrainer
from paddleformers.cli.train.sft import workflow as sft_workflow
from paddleformers.cli.train.sft.sft_trainer import SFTTrainer
from paddleformers.trainer import PdArgumentParser

from ..config.schema import ConfigError
from ..engine.api import FSDPModule
from .paddleformers import HSDPTrainer, HSDPTrainingArguments, shard_for_training

logger = logging.getLogger(__name__)

# the CLI's stages this runs; the others (VL, the pretraining recipes) build other
# models and trainers that HSDP does not shard yet
STAGES = ("SFT", "PT", "DPO")
# compute_type -> (bf16, fp16), set before HSDP reads them (the CLI's own
# __post_init__ sets them from compute_type only after HSDP's checks ran)
_COMPUTE_TYPES = {"bf16": (True, False), "float32": (False, False)}


@dataclass
class HSDPFinetuningArguments(HSDPTrainingArguments, FinetuningArguments):
    """The CLI's ``FinetuningArguments`` with HSDP's keys (HSDPTrainingArguments')."""

    def __post_init__(self) -> None:
        if self.compute_type not in _COMPUTE_TYPES:
            raise ConfigError([
                f"HSDPFinetuningArguments: compute_type: {self.compute_type!r}; allowed "
                f"with HSDP: {', '.join(repr(c) for c in _COMPUTE_TYPES)} (fp16 needs loss "
                "scaling over shards; the quantized types are not sharded)"])
        self.bf16, self.fp16 = _COMPUTE_TYPES[self.compute_type]
        super().__post_init__()


class HSDPSFTTrainer(HSDPTrainer, SFTTrainer):
    """The CLI's ``SFTTrainer`` (its data, generation and logging) over an HSDP-sharded
    model, with HSDPTrainer's training, checkpoints and saves."""


class HSDPDPOTrainer(HSDPTrainer, DPOTrainer):
    """The CLI's ``DPOTrainer`` (its loss, reference log-probs and metrics) over an
    HSDP-sharded policy. Full fine-tuning's reference model is sharded like the policy
    (the same config), where the CLI's would wrap it in ``fleet.distributed_model``:
    each rank holds 1 / inner of its weights, and gathers one unit at a time in its
    forward, which runs under ``no_grad`` (no backward, so no reduction)."""

    def _wrap_ref_model(self, model: Any) -> Any:
        # (the CLI's evaluate() passes the policy here too: already sharded)
        if model is None or isinstance(model, FSDPModule):
            return model
        _, plan = shard_for_training(model, self.args.hsdp_config_resolved)
        local = sum(p._numel() * p.element_size() for p in model.parameters())
        logger.info("HSDPDPOTrainer: reference model sharded like the policy: %d "
                    "parameter bytes on this rank (%s)", local, plan)
        return model


class _PlainLoaderOnCPU:
    """A model class whose ``from_pretrained`` reads with the plain loader when
    flex_checkpoint is asked for on a build without CUDA (flex_checkpoint's reshard
    moves tensors with ``.cuda()``; both give the same weights). Everything else, a
    call of the class included, is the wrapped class's."""

    def __init__(self, cls: Any) -> None:
        self._cls = cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._cls(*args, **kwargs)

    def from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("load_checkpoint_format") == "flex_checkpoint" and \
                not paddle.is_compiled_with_cuda():
            kwargs["load_checkpoint_format"] = None
        return self._cls.from_pretrained(*args, **kwargs)


def check_stage(args: dict) -> None:
    """Refuse a stage HSDP does not run (alike on every rank, before any group)."""
    stage = args.get("stage", "SFT")
    if stage not in STAGES:
        raise ConfigError([f"stage: {stage!r}; allowed with paddle_hsdp: "
                           f"{', '.join(repr(s) for s in STAGES)} (the VL and pretraining "
                           "recipes build models HSDP does not shard yet)"])
    update = args.get("ref_model_update_steps", -1)
    if stage == "DPO" and update is not None and int(update) > 0:
        raise ConfigError([f"ref_model_update_steps: {update!r}; allowed with paddle_hsdp: "
                           "-1 (copying the sharded policy into the sharded reference model "
                           "is not done yet)"])


_installed: dict[str, Any] = {}


def install() -> None:
    """Swap the CLI's arguments, trainer and CPU loader (see the module docstring).
    Idempotent: the plugin may run after ``python -m paddle_hsdp.train`` installed it."""
    if _installed:
        return
    original_parse_dict = PdArgumentParser.parse_dict

    def parse_dict(self: PdArgumentParser, args: dict, *rest: Any, **kwargs: Any) -> Any:
        if FinetuningArguments in self.dataclass_types:
            check_stage(args)
            self.dataclass_types = [HSDPFinetuningArguments if t is FinetuningArguments
                                    else t for t in self.dataclass_types]
        return original_parse_dict(self, args, *rest, **kwargs)

    PdArgumentParser.parse_dict = parse_dict
    _installed.update(parse_dict=original_parse_dict,
                      trainer=sft_workflow.SFTTrainer,
                      model_class=sft_workflow.AutoModelForCausalLM,
                      lora_class=sft_workflow.LoRAModel, dpo_trainer=dpo_workflow.DPOTrainer)
    sft_workflow.SFTTrainer = HSDPSFTTrainer
    dpo_workflow.DPOTrainer = HSDPDPOTrainer
    model_class = _PlainLoaderOnCPU(_installed["model_class"])
    lora_class = _PlainLoaderOnCPU(_installed["lora_class"])
    for workflow in (sft_workflow, dpo_workflow):  # (both import the same two classes)
        workflow.AutoModelForCausalLM, workflow.LoRAModel = model_class, lora_class


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    if not _installed:
        return
    PdArgumentParser.parse_dict = _installed["parse_dict"]
    sft_workflow.SFTTrainer = _installed["trainer"]
    dpo_workflow.DPOTrainer = _installed["dpo_trainer"]
    for workflow in (sft_workflow, dpo_workflow):
        workflow.AutoModelForCausalLM = _installed["model_class"]
        workflow.LoRAModel = _installed["lora_class"]
    _installed.clear()


def hsdp_keys() -> list[str]:
    """The YAML keys HSDP adds to the CLI's."""
    own = {f.name for f in dataclasses.fields(FinetuningArguments)}
    return sorted(f.name for f in dataclasses.fields(HSDPFinetuningArguments)
                  if f.name not in own)
