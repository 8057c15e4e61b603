"""The paddleformers-cli plugin in one process (issue 67): what ``install()`` swaps in
the CLI, the refusals made while the YAML is parsed (before any process group), the
example YAML's keys, and ``python -m paddle_hsdp.train``'s own options. The CLI's
training on 2 and 4 ranks: test_collective/test_paddleformers_cli.py."""

import os
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("paddleformers.cli", reason="PaddleFormers is an optional extra: "
                    "pip install paddle_hsdp[paddleformers] (tools/test.sh installs it)")

from paddleformers.cli.hparams import parser as cli_parser  # noqa: E402
from paddleformers.cli.train.dpo import workflow as dpo_workflow  # noqa: E402
from paddleformers.cli.train.sft import workflow  # noqa: E402

from paddle_hsdp import ConfigError  # noqa: E402
from paddle_hsdp.integrations import paddleformers_cli  # noqa: E402
from paddle_hsdp.train import plugin_path, read_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "tools", "configs", "paddleformers_sft_hsdp.yaml")


@pytest.fixture
def installed():
    paddleformers_cli.install()
    paddleformers_cli.install()  # (idempotent: the plugin may run after the entry point)
    yield
    paddleformers_cli.uninstall()


def parse(values: dict):
    return cli_parser._parse_train_args(dict(values))


def cpu_yaml(tmp_path, **extra) -> dict:
    values = read_config(EXAMPLE, [])
    values.pop("custom_register_path")
    values.update(output_dir=str(tmp_path), device="cpu", compute_type="float32",
                  amp_master_grad=False, fsdp_outer_degree=1, report_to="none")
    values.update(extra)
    return values


def test_the_cli_builds_hsdp_arguments_and_trainer(installed, tmp_path):
    *_, args = parse(cpu_yaml(tmp_path, sharding="stage2 offload"))
    assert type(args).__name__ == "HSDPFinetuningArguments"
    cfg = args.hsdp_config_resolved
    assert (cfg.fsdp_outer_degree, cfg.zero_stage, cfg.offload_to_cpu) == (1, 2, True)
    assert args.sharding == [] and not args.bf16
    assert workflow.SFTTrainer is paddleformers_cli.HSDPSFTTrainer
    assert dpo_workflow.DPOTrainer is paddleformers_cli.HSDPDPOTrainer
    assert dpo_workflow.AutoModelForCausalLM is workflow.AutoModelForCausalLM


def test_optim_muon_selects_hsdp_muon_with_owned_matrices(installed, tmp_path):
    """``optim: muon`` (PaddleFormers' own key) is paddle_hsdp.Muon under HSDP: each
    matrix it updates whole on one rank, the Trainer's muon_* keys passed on."""
    import paddle

    from paddle_hsdp.integrations.paddleformers import hsdp_muon
    *_, args = parse(cpu_yaml(tmp_path, optim="muon", muon_qkv_update_mode="fused_qkv",
                              muon_ffn_split=False, muon_momentum=0.9, muon_ns_steps=3,
                              muon_exclude_patterns=["embed", "lm_head"]))
    assert args.hsdp_config_resolved.owned_matrices
    model = paddle.nn.Layer()
    model.proj, model.norm = paddle.nn.Linear(4, 4), paddle.nn.LayerNorm(4)
    model.lm_head = paddle.nn.Linear(4, 8)
    opt = hsdp_muon(model, args, None, 0.01)
    assert (opt._momentum, opt._ns_steps, opt._epsilon) == (0.9, 3, args.adam_epsilon)
    assert [opt.updates_as_matrix(p) for p in model.parameters()] == [
        True, False, False, False, False, False]  # proj's weight; lm_head by its name
    decays = [opt._apply_decay_param_fun(p.name) for p in model.parameters()]
    assert decays == [True, False, False, False, True, False]  # not norms, not biases




def test_on_cpu_the_workflow_loads_with_the_plain_loader(installed, monkeypatch):
    """flex_checkpoint's load calls .cuda(): on a build without CUDA the workflow's
    from_pretrained calls (the model's; LoRAModel's for lora_path) get the plain
    loader; a LoRAModel is still built by calling the class."""
    seen = []

    class Recorder:
        def __init__(self, *args):
            seen.append(("built", args))

        @classmethod
        def from_pretrained(cls, *args, load_checkpoint_format="flex_checkpoint"):
            seen.append(("loaded", load_checkpoint_format))

    monkeypatch.setattr(paddleformers_cli.paddle, "is_compiled_with_cuda", lambda: False)
    for shim in (workflow.AutoModelForCausalLM, workflow.LoRAModel):
        monkeypatch.setattr(shim, "_cls", Recorder)
        shim.from_pretrained("path", load_checkpoint_format="flex_checkpoint")
        shim.from_pretrained("path", load_checkpoint_format="unified_checkpoint")
    workflow.LoRAModel("model", "config")
    assert seen == [("loaded", None), ("loaded", "unified_checkpoint")] * 2 + [
        ("built", ("model", "config"))], seen


def test_the_example_yaml_holds_only_keys_the_parser_knows(installed, tmp_path):
    with open(EXAMPLE) as f:
        keys = set(yaml.safe_load(f)) - {"custom_register_path"}
    parse(cpu_yaml(tmp_path))  # an unknown key would raise ValueError naming it
    assert {"fsdp_outer_degree", "sharding"} <= keys
    assert set(paddleformers_cli.hsdp_keys()) >= {
        "fsdp_outer_degree", "fsdp_outer_sharding", "hsdp_config", "hsdp_wrap_modules",
        "hsdp_checkpoint", "hsdp_async_save"}


@pytest.mark.parametrize("bad,named", [
    ({"stage": "VL-SFT"}, "stage: 'VL-SFT'; allowed with paddle_hsdp: 'SFT', 'PT', 'DPO'"),
    ({"stage": "DPO", "ref_model_update_steps": 2}, "ref_model_update_steps: 2; allowed"),
    ({"optim": "muon"}, "muon_qkv_update_mode: 'split_head'; allowed with HSDP's Muon: "
     "'fused_qkv'"),
    ({"optim": "muon", "muon_qkv_update_mode": "fused_qkv"}, "muon_ffn_split: True; allowed"),
    ({"compute_type": "fp16"}, "compute_type: 'fp16'; allowed with HSDP: 'bf16', 'float32'"),
    ({"sharding": "stage5"}, "sharding: 'stage5'; allowed"),
    ({"fsdp_outer_degree": 3}, "fsdp_outer_degree: 3 does not divide"),
])
def test_bad_keys_are_refused_while_the_yaml_is_parsed(installed, tmp_path, bad, named):
    with pytest.raises(ConfigError) as e:
        parse(cpu_yaml(tmp_path, **bad))
    assert named in str(e.value), str(e.value)


def test_uninstall_gives_the_cli_back(tmp_path):
    paddleformers_cli.install()
    paddleformers_cli.uninstall()
    assert workflow.SFTTrainer.__name__ == "SFTTrainer"
    assert dpo_workflow.DPOTrainer.__name__ == "DPOTrainer"
    with pytest.raises(ValueError, match="fsdp_outer_degree"):  # the CLI's own refusal
        parse(cpu_yaml(tmp_path))


def test_the_entry_point_prints_the_plugin_path_and_reads_overrides(tmp_path):
    out = subprocess.run([sys.executable, "-m", "paddle_hsdp.train", "--plugin-path"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == plugin_path() and os.path.isfile(plugin_path())
    values = read_config(EXAMPLE, ["fsdp_outer_degree=2", "max_steps=5"])
    assert (values["fsdp_outer_degree"], values["max_steps"]) == (2, 5)
