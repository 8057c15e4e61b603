"""The PaddleFormers Trainer tests' model, data and run recorder (issue 18).

A tiny ``LlamaForCausalLM`` with tied embeddings (RMSNorm unfused: the fused kernel has
no CPU build), 48 samples of 16 tokens, global batch 8 (one process: 8 per device; 4
ranks: 2 each, or 1 each with 2 accumulation steps), 6 steps of AdamW with clipping at
0.5, active every step (the pre-clip norms are 1.7 to 2.0).

Runs are compared in float64 (workers/parity.py's bound for norms and parameters): in
float32 this model's own noise floor is above useful bounds (the one-process Trainer
with 2 accumulation steps instead of 1, the same math in another float order, moves
final parameters by 6e-5 relative: AdamW turns float noise in the q_proj grads, which
are near zero, into full-size updates); in float64 the same comparison moves them by
1e-13. The logged losses stay float32-level (the loss is reduced in float32 and logged
rounded to 8 decimals: 6e-8 apart between those two references).
"""

from __future__ import annotations

import json
import math

import numpy as np
import paddle

from paddleformers.trainer import TrainerCallback
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

STEPS, GLOBAL_BATCH, SEQ, VOCAB, SAMPLES = 6, 8, 16, 64, 48
CLIP = 0.5
DTYPE = "float64"
# losses: float32-level (see above), 16x the measured 6e-8; norms and parameters: float64
LOSS_BOUND = 1e-6
# The tensor- and pipeline-parallel runs (worker_trainer_3d.py) and their reference: no
# weight decay. PaddleFormers' Trainer exempts parameters whose structured name holds
# "bias" or "norm"; a pipeline model's final norm is named "<layer index>.weight", so
# it would be decayed there and not in the one-process model (a 3e-5 relative loss
# difference at step 2, measured): the Trainer's choice, not HSDP's.
WEIGHT_DECAY_3D = 0.0


def build_config(recompute: bool = False, tied: bool = True) -> LlamaConfig:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=tied,
                         fuse_rms_norm=False)
    if recompute:
        config.recompute_granularity = "full"
    return config


def build_model(recompute: bool = False, dtype: str = DTYPE, tied: bool = True):
    """The one-process model, the same weights every time (seed 7)."""
    paddle.set_default_dtype(dtype)
    paddle.seed(7)
    return LlamaForCausalLM(build_config(recompute, tied))


class TokenData(paddle.io.Dataset):
    """``low=1``: without token 0, the pad token, which a one-process embedding
    (``padding_idx``) gives no grad and tensor-parallel and pipeline embeddings do
    (Paddle 3.3's VocabParallelEmbedding, PaddleFormers' EmbeddingPipe).
    ``causal_mask``: each sample also carries a causal attention mask ``[1, SEQ, SEQ]``:
    PaddleFormers' ``LlamaForCausalLMPipe`` attends without one to every position on CPU
    (its first stage passes no mask on; measured: the loss of a batch 5.022 against the
    one-process model's 5.100, equal with the mask), and ``LlamaForCausalLM`` gives the
    same loss with or without it."""

    CAUSAL = np.tril(np.ones([SEQ, SEQ]))[None]

    def __init__(self, n=SAMPLES, seed=1, low=0, causal_mask=False):
        self.x = np.random.RandomState(seed).randint(low, VOCAB, size=(n, SEQ)).astype("int64")
        self.causal_mask = causal_mask

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        sample = {"input_ids": self.x[i], "labels": self.x[i]}
        if self.causal_mask:
            sample["attention_mask"] = self.CAUSAL.astype(paddle.get_default_dtype())
        return sample


# optim: muon (paddle_hsdp.Muon under HSDP), with the two keys it needs set to whole
# matrices, and fewer Newton-Schulz steps than the default 5 (the test's time)
MUON_ARGS = {"optim": "muon", "muon_qkv_update_mode": "fused_qkv", "muon_ffn_split": False,
             "muon_ns_steps": 3}


def common_args(output_dir: str, per_device: int, accumulation: int = 1, **extra) -> dict:
    args = dict(output_dir=output_dir, per_device_train_batch_size=per_device,
                per_device_eval_batch_size=per_device, gradient_accumulation_steps=accumulation,
                max_steps=STEPS, logging_steps=1, learning_rate=1e-2, max_grad_norm=CLIP,
                weight_decay=0.01, warmup_steps=0, seed=0, disable_tqdm=True, report_to="none",
                save_strategy="no", dataloader_drop_last=True, do_eval=False)
    args.update(extra)
    return args


class Recorder(TrainerCallback):
    """Per optimizer step: the logged loss, and the pre-clip global norm (``norm_of``
    reads it: from the grads before the step, or HSDP's ``last_global_norm`` after)."""

    def __init__(self, norm_before=None, norm_after=None):
        self.losses, self.norms, self.logged_norms = [], [], []
        self.norm_before, self.norm_after = norm_before, norm_after

    def on_optimizer_begin(self, args, state, control, **kwargs):
        if self.norm_before is not None:
            self.norms.append(self.norm_before())

    def on_step_end(self, args, state, control, **kwargs):
        if self.norm_after is not None:
            self.norms.append(self.norm_after())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and "train_runtime" not in logs:
            self.losses.append(float(logs["loss"]))
            if "global_norm" in logs:
                self.logged_norms.append(float(logs["global_norm"]))


def grad_norm_of(model):
    def norm():
        total = sum(float((p.grad.astype("float64") ** 2).sum())
                    for p in model.parameters() if p.grad is not None)
        return math.sqrt(total)
    return norm


def params_of(state: dict) -> dict:
    return {k: np.asarray(v.numpy(), dtype=np.float64) for k, v in state.items()}


def save_record(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f)
