"""HSDPTrainingArguments and HSDPTrainer's checks, in one process (issue 18): what is
refused (ConfigError naming the argument, before fleet.init), how the arguments become
an apply_config config, and which modules 'auto' wraps. The numerics run on 4 ranks in
test_collective/test_trainer.py."""

import subprocess
import sys

import pytest

pytest.importorskip("paddleformers.trainer", reason="PaddleFormers is an optional extra: "
                    "pip install paddle_hsdp[paddleformers] (tools/test.sh installs it)")

from paddleformers.trainer import TrainingArguments  # noqa: E402
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from paddle_hsdp import ConfigError  # noqa: E402
from paddle_hsdp.integrations.paddleformers import (HSDPTrainer,  # noqa: E402
                                                    HSDPTrainingArguments,
                                                    main_stack_patterns)


def make(tmp_path, **kwargs):
    return HSDPTrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)


@pytest.mark.parametrize("bad,named", [
    ({"sharding": "stage4"}, "sharding: 'stage4'; allowed: empty, 'stage1', 'stage2' or "
     "'stage3' (HSDP's zero_stage 1-3)"),
    ({"sharding": "stage1 stage3"}, "sharding: 'stage1 stage3'; allowed"),
    ({"sharding": "stage2", "hsdp_config": {"zero_stage": 3}},
     "sharding: means zero_stage 2, but hsdp_config says zero_stage 3"),
    ({"sharding_parallel_size": 2}, "sharding_size: 2 does not divide the world size 1"),
    ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size: 2 x "
     "pipeline_model_parallel_size: 1 = 2 does not divide the 1 ranks"),
    ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size: 2 = 2 does not divide"),
    ({"sep_parallel_size": 2}, "sep_parallel_size: 2; HSDPTrainer does not set up"),
    ({"expert_model_parallel_size": 2}, "expert_model_parallel_size: 2 does not divide the "
     "1 ranks"),
    ({"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
     "expert_model_parallel_size: 2 together with tensor or pipeline parallelism"),
    ({"fsdp_outer_sharding": "params"}, "fsdp_outer_sharding: 'params'; allowed: 'none', "
     "'optim'"),
    ({"hsdp_config": {"fsdp_outer_sharding": "optim"}, "fsdp_outer_sharding": "none"},
     "fsdp_outer_sharding: 'none' disagrees with hsdp_config's"),
    ({"use_expert_parallel": True}, "use_expert_parallel: True switches on PaddleFormers'"),
    ({"fp16": True}, "fp16: not supported"),
    ({"fsdp_outer_degree": "two"}, "fsdp_outer_degree: 'two'; allowed: an int >= 1 or 'auto'"),
    ({"fsdp_outer_degree": 0}, "fsdp_outer_degree: 0"),
    ({"fsdp_outer_degree": 3}, "fsdp_outer_degree: 3 does not divide the world size 1"),
    ({"save_checkpoint_format": "unified_checkpoint"}, "save_checkpoint_format: 'unified"),
    ({"load_checkpoint_format": "sharding_io"}, "load_checkpoint_format: 'sharding_io'"),
    ({"hsdp_checkpoint": False, "save_checkpoint_format": None},
     "save_checkpoint_format: None saves or loads on rank 0 only"),
    ({"hsdp_config": {"fsdp_outer_degree": 2}, "fsdp_outer_degree": 1},
     "fsdp_outer_degree: 1 disagrees with hsdp_config's fsdp_outer_degree 2"),
    ({"hsdp_config": {"sub_modules_to_wrap": ["model.layers.{*}"]},
      "hsdp_wrap_modules": "LlamaDecoderLayer"}, "hsdp_wrap_modules: 'LlamaDecoderLayer'"),
    ({"hsdp_config": {"param_dtype": "fp16"}, "bf16": True},
     "param_dtype 'fp16' disagrees with --bf16"),
    ({"hsdp_config": {"shardng_size": 2}}, "did you mean 'sharding_size'"),
])
def test_refusals_name_the_argument(tmp_path, bad, named):
    with pytest.raises(ConfigError) as e:
        make(tmp_path, **bad)
    assert named in str(e.value), str(e.value)
    assert all(line.startswith("HSDPTrainingArguments: ") for line in e.value.errors)


def test_the_arguments_become_an_apply_config_config(tmp_path):
    args = make(tmp_path, bf16=True, amp_master_grad=True, fsdp_outer_degree="1",
                hsdp_config={"zero_stage": 2})
    cfg = args.hsdp_config_resolved
    assert (cfg.fsdp_outer_degree, cfg.zero_stage) == (1, 2)
    assert (cfg.param_dtype, cfg.reduce_dtype) == ("bf16", "fp32")
    assert cfg.sub_modules_to_wrap == ("auto",)
    assert args.hsdp_degrees == (1, 1)
    # PaddleFormers' own sharding stays off; checkpoints go through its flex hooks
    assert args.sharding == [] and args.save_checkpoint_format == "flex_checkpoint"
    explicit = make(tmp_path, hsdp_wrap_modules="model.layers.{*}, lm_head")
    assert explicit.hsdp_config_resolved.sub_modules_to_wrap == ("model.layers.{*}", "lm_head")


@pytest.mark.parametrize("given,want", [
    ({"sharding": "stage1"}, {"zero_stage": 1}),
    ({"sharding": "stage2"}, {"zero_stage": 2}),
    ({"sharding": "stage3 offload"}, {"zero_stage": 3, "offload_to_cpu": True}),
    ({"sharding": ["stage3", "offload"]}, {"zero_stage": 3, "offload_to_cpu": True}),
    ({"sharding": "stage1", "sharding_parallel_size": 1}, {"zero_stage": 1}),
])
def test_paddleformers_sharding_keys_map_onto_the_hsdp_config(tmp_path, given, want):
    """PaddleFormers' ``sharding: stageN [offload]`` and ``sharding_parallel_size``
    become HSDP's zero_stage, offload_to_cpu and sharding_size (the inner degree); its
    own sharding stays off."""
    args = make(tmp_path, **given)
    cfg = args.hsdp_config_resolved
    for name, value in want.items():
        assert getattr(cfg, name) == value, (name, getattr(cfg, name))
    assert args.sharding == [] and args.sharding_parallel_size == -1


def test_auto_wraps_the_main_stack_of_blocks():
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)
    assert main_stack_patterns(LlamaForCausalLM(config)) == ("model.layers.{*}",)


def test_the_trainer_wants_hsdp_arguments(tmp_path):
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", sharding="",
                             amp_master_grad=False)
    with pytest.raises(TypeError, match="args must be HSDPTrainingArguments"):
        HSDPTrainer(model=LlamaForCausalLM(config), args=args)


def test_expert_parallelism_needs_a_model_with_experts(tmp_path):
    """expert_model_parallel_size > 1 over a model with no expert parameters (neither
    marked nor named in hsdp_config's expert_modules) is refused before sharding (alike
    on every rank; the degree is forced here: one process cannot hold ep 2)."""
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    args = make(tmp_path)
    args.expert_model_parallel_size = 2
    model = LlamaForCausalLM(config)
    with pytest.raises(ConfigError, match="expert_model_parallel_size 2, but the model has "
                                          "no expert parameters: mark them"):
        HSDPTrainer(model=model, args=args)
    assert not hasattr(model, "_hsdp_unit")  # nothing was sharded


def test_importing_the_package_does_not_import_paddleformers():
    code = "import sys, paddle_hsdp; assert 'paddleformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_hsdp_async_save_reaches_save_checkpoint(tmp_path, monkeypatch):
    """hsdp_async_save=True: the Trainer's checkpoint hooks save asynchronously (the
    numerics of an async save: test_collective/test_checkpoint.py); refused without
    hsdp_checkpoint; an unpublished save named at resume."""
    from paddle_hsdp.integrations import paddleformers as integration

    calls = []
    monkeypatch.setattr(integration, "save_checkpoint",
                        lambda *a, **k: calls.append((len(a), k)))
    args = make(tmp_path, hsdp_async_save=True)

    class Stub:
        pass
    trainer = Stub()
    trainer.args, trainer.model, trainer.optimizer = args, object(), object()
    trainer._hsdp_in_checkpoint = True
    HSDPTrainer._save_flex_optimizer_state(trainer, str(tmp_path))
    args.ignore_save_lr_and_optim = True
    HSDPTrainer.save_model(trainer, str(tmp_path))
    assert calls == [(3, {"async_save": True, "trainable_only": False}),
                     (2, {"async_save": True, "trainable_only": False})], calls
    with pytest.raises(ConfigError, match="hsdp_async_save: True needs hsdp_checkpoint=True"):
        make(tmp_path, hsdp_async_save=True, hsdp_checkpoint=False)
    with pytest.raises(ConfigError, match="save_total_limit: 1 with hsdp_async_save"):
        make(tmp_path, hsdp_async_save=True, save_total_limit=1)
    (tmp_path / "checkpoint-4" / "hsdp.tmp-1f").mkdir(parents=True)
    (tmp_path / "checkpoint-2" / "hsdp").mkdir(parents=True)
    with pytest.raises(integration.CheckpointError, match="was not published.*checkpoint-2"):
        HSDPTrainer._load_flex_checkpoint(trainer, str(tmp_path / "checkpoint-4"))
