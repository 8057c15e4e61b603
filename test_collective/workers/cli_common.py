"""The paddleformers-cli tests' inputs (issue 67), built offline: a tiny Llama saved with
``save_pretrained`` (float32, untied, RMSNorm unfused), a 64-word tokenizer
(``tokenizers``' WordLevel, saved as PaddleFormers' AutoTokenizer reads it), 64 SFT
SFT samples and 64 DPO pairs (prompt, chosen, rejected) in the CLI's erniekit format,
and the YAMLs: one for PaddleFormers' own
data-parallel run, and the same YAML with HSDP's lines added.

What the CLI needs on CPU (PaddleFormers 1.2): ``device: cpu``, ``compute_type:
float32`` (with ``amp_master_grad: false``, which PaddleFormers otherwise sets for
bf16), ``sharding: ""``, eager attention, a seed above 0, and ``load_checkpoint_format:
""`` / ``save_checkpoint_format: ""`` for PaddleFormers' own run (its flex_checkpoint
load calls ``.cuda()``; under HSDP the plugin takes the plain loader there itself).
"""

from __future__ import annotations

import json
import os
import random

import yaml

VOCAB = 64
WORDS = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB - 4)]
SAMPLES = 64
STEPS = 6


def write_model(folder: str) -> None:
    """The base model and its tokenizer (the same weights every time: seed 7)."""
    import paddle
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(folder)
    paddle.set_default_dtype("float32")
    paddle.seed(7)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         fuse_rms_norm=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    LlamaForCausalLM(config).save_pretrained(folder)


def write_data(path: str) -> None:
    rows = random.Random(1)
    with open(path, "w") as f:
        for _ in range(SAMPLES):
            src, tgt = (" ".join(f"w{rows.randrange(VOCAB - 4)}"
                                 for _ in range(rows.randrange(3, 8))) for _ in range(2))
            f.write(json.dumps({"src": [src], "tgt": [tgt]}) + "\n")


def write_dpo_data(path: str) -> None:
    rows = random.Random(2)

    def words(low: int, high: int) -> str:
        return " ".join(f"w{rows.randrange(VOCAB - 4)}" for _ in range(rows.randrange(low, high)))

    with open(path, "w") as f:
        for _ in range(SAMPLES):  # sort: the higher one is chosen
            f.write(json.dumps({"src": [words(3, 8)], "tgt": [],
                                "response": [[words(2, 6)], [words(2, 6)]],
                                "sort": [1, 0]}) + "\n")


def base_yaml(work: str, output_dir: str, fine_tuning: str, per_device: int = 2,
              stage: str = "SFT") -> dict:
    """PaddleFormers' own run of the CLI on CPU: plain data parallelism."""
    data = os.path.join(work, "dpo.jsonl" if stage == "DPO" else "train.jsonl")
    return {
        "stage": stage, "fine_tuning": fine_tuning,
        "model_name_or_path": os.path.join(work, "model"),
        "train_dataset_type": "erniekit", "train_dataset_path": data,
        "train_dataset_prob": "1.0", "eval_dataset_type": "erniekit",
        "eval_dataset_path": data, "eval_dataset_prob": "1.0", "dataset_type": "map",
        "max_seq_len": 32, "random_shuffle": False, "output_dir": output_dir,
        "overwrite_output_dir": True, "max_steps": STEPS,
        "per_device_train_batch_size": per_device, "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-2, "warmup_steps": 0, "logging_steps": 1,
        "save_strategy": "no", "do_train": True, "do_eval": False, "seed": 42,
        "device": "cpu", "sharding": "", "_attn_implementation": "eager",
        "compute_type": "float32", "amp_master_grad": False, "disable_tqdm": True,
        "report_to": "none", "load_checkpoint_format": "", "save_checkpoint_format": ""}


def write_yaml(path: str, values: dict) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(values, f, sort_keys=False)
    return path


if __name__ == "__main__":  # python cli_common.py WORK: the model, tokenizer and data
    import sys

    work = sys.argv[1]
    os.makedirs(os.path.join(work, "model"), exist_ok=True)
    write_model(os.path.join(work, "model"))
    write_data(os.path.join(work, "train.jsonl"))
    write_dpo_data(os.path.join(work, "dpo.jsonl"))
    print("CLI_INPUTS_WRITTEN", flush=True)
