"""PaddleFormers' Trainer with HSDP: train a small Llama through HSDPTrainer, evaluate,
save a checkpoint and a from_pretrained directory (run by tools/train_trainer.sh on 4
CPU ranks). Every HSDPTrainingArguments / TrainingArguments flag works
(--fsdp_outer_degree, --hsdp_config, --max_steps, --recompute_granularity full, ...)."""

import os
import sys
import time

import numpy as np

import paddle_hsdp  # noqa: F401  (before anything runs fleet.init)
import paddle
import paddle.distributed as dist
from paddleformers.trainer import PdArgumentParser
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

from paddle_hsdp.integrations.paddleformers import HSDPTrainer, HSDPTrainingArguments

VOCAB, SEQ = 128, 32


class CountingData(paddle.io.Dataset):
    """Token sequences that count up from a random start (mod the vocabulary): a
    next-token task a small model learns in a few dozen steps."""

    def __init__(self, n, seed):
        starts = np.random.RandomState(seed).randint(0, VOCAB, size=n)
        self.x = ((starts[:, None] + np.arange(SEQ)[None, :]) % VOCAB).astype("int64")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


DEFAULTS = {"output_dir": f"runs/trainer-{time.strftime('%Y%m%d-%H%M%S')}",
            "fsdp_outer_degree": "2", "max_steps": "40", "per_device_train_batch_size": "4",
            "per_device_eval_batch_size": "4", "learning_rate": "3e-3", "max_grad_norm": "1.0",
            "logging_steps": "10", "save_strategy": "steps", "save_steps": "20",
            "report_to": "none", "disable_tqdm": "true", "seed": "0"}


def parse(argv):
    given = {a.split("=")[0][2:] for a in argv if a.startswith("--")}
    defaults = [x for k, v in DEFAULTS.items() if k not in given for x in (f"--{k}", v)]
    (args,) = PdArgumentParser(HSDPTrainingArguments).parse_args_into_dataclasses(
        args=defaults + argv)
    return args


def main():
    args = parse(sys.argv[1:])
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=True,
                         fuse_rms_norm=False)  # the fused kernel has no CPU build
    trainer = HSDPTrainer(model=LlamaForCausalLM(config), args=args,
                          train_dataset=CountingData(2048, seed=1),
                          eval_dataset=CountingData(64, seed=2))
    result = trainer.train()
    metrics = trainer.evaluate()
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    if dist.get_rank() == 0:
        outer, inner = args.hsdp_degrees
        print(f"[trainer] HSDP {outer} x {inner}: train loss {result.training_loss:.3f}, "
              f"eval loss {metrics['eval_loss']:.3f} after {result.global_step} steps")
        print(f"[trainer] checkpoints: {args.output_dir}/checkpoint-*/ (resume with "
              f"--resume_from_checkpoint); from_pretrained directory: {final}")


if __name__ == "__main__":
    main()
