"""Tensor and pipeline parallelism in the planner: which degrees a model and a cluster
allow, and what each costs per rank and per step beside HSDP's own traffic
(config/planner.py). Every figure is a formula of the model's sizes; what it leaves out
is said where it is made.

Ranks are placed as fleet places them (``hybrid_parallel_order`` dp, pp, sharding, sep,
mp: mp fastest), so with ``T`` = tp, ``D`` = sharding ranks (inner x outer), a tensor
parallel group is ``T`` consecutive ranks, an inner HSDP group ``I`` ranks ``T`` apart,
an outer group ``O`` ranks ``I * T`` apart, and the stages of a pipeline ``D * T`` apart.

* **Global batch.** Layouts are compared at the same tokens per optimizer step:
  ``global_batch`` sequences (default: ``micro_steps`` micro-batches per rank of the
  pure data-parallel layout), so a layout with ``D`` data-parallel ranks runs
  ``global_batch / (D * micro_batch)`` micro-batches per step.
* **Parameters per rank** of the heaviest stage: its ``layers / pp`` decoder layers and
  the embedding or the head (both with pp 1), every matrix split ``T`` ways (norms are
  replicated), then sharded by HSDP as today.
* **Activations** (flash attention: no ``s^2`` term; Korthikanti et al. 2022, for
  2-byte activations, scaled to the compute dtype's size ``a``): per layer and
  micro-batch of ``b`` sequences of ``s`` tokens, ``a/2 s b h (10 + 24 / T)`` bytes,
  ``a/2 34 s b h / T`` with sequence parallelism (assumed whenever ``T > 1``, as
  Megatron-LM and PaddleFormers run it); with full recompute only each layer's input,
  ``a s b h`` (``/ T`` with sequence parallelism). Under 1F1B the first stage holds
  ``min(pp, micro-batches)`` micro-batches in flight; the last stage adds the float32
  logits of one micro-batch, ``4 s b V / T``.
* **Tensor parallel traffic**: per layer and micro-batch, forward and backward, one
  all-reduce of ``a s b h`` bytes over the tensor-parallel group per row-parallel layer
  (forward) and per column-parallel layer's input (backward): 7 for PaddleFormers'
  Llama (q, k, v, gate and up apart), 4 with fused q/k/v and gate/up (``fused=1``, as
  Megatron-LM); with sequence parallelism all-gathers and reduce-scatters of the same
  bytes. Beside the layers, the vocabulary-parallel embedding (forward) and head
  (backward) one each. They sit on the critical path: always exposed.
* **Pipeline**: per micro-batch and stage boundary, one activation forward and one grad
  backward, ``a s b h`` bytes each (``/ T`` with sequence parallelism), point to point;
  exposed. PaddleFormers' pipeline models send the positions along (int64 ids ``s b``,
  RoPE's cos and sin ``2 s b h / heads`` in the compute dtype) with each forward
  activation. The bubble, ``(pp - 1) / (m + pp - 1)`` of the step for ``m`` micro-batches,
  is idle time: ``compute * (pp - 1) / m``, with compute from ``6 * params * tokens``
  FLOPs at the cluster's ``achieved_tflops`` per device (without that key the bubble is
  shown as a fraction only, not timed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

RESERVE = 0.1  # of device memory kept free: allocator fragmentation, workspaces, buffers


class Shape(Protocol):
    """What these formulas read of a model's sizes (config/planner.py's ``ModelShape``,
    which imports this module)."""

    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads_fraction(self) -> float: ...
    @property
    def tp_collectives_per_layer(self) -> int: ...
    def params(self) -> int: ...


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes: ``global_batch`` sequences (None: see the
    module docstring) of ``seq_len`` tokens in micro-batches of ``micro_batch``."""

    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int | None = None
    recompute: bool = False
    act_bytes: int = 2  # the compute dtype's element size (bf16)

    def micro_steps(self, data_parallel: int, default_micro_steps: int, world: int) -> int:
        """Micro-batches per step per data-parallel rank, for ``data_parallel`` ranks."""
        total = self.global_batch or default_micro_steps * self.micro_batch * world
        return max(1, math.ceil(total / (data_parallel * self.micro_batch)))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_choices(shape: Shape, ranks_per_node: int) -> list[int]:
    """Tensor degrees that keep a tensor-parallel group inside one machine and split the
    heads (and the key-value heads) evenly."""
    kv_heads = max(1, round(shape.heads * shape.kv_heads_fraction))
    return [t for t in divisors(ranks_per_node) if shape.heads % t == 0 and kv_heads % t == 0]


def pp_choices(shape: Shape) -> list[int]:
    """Pipeline degrees that give every stage the same number of decoder layers."""
    return divisors(shape.layers)


def activation_bytes(shape: Shape, work: Workload, tp: int, pp: int, micro: int) -> float:
    """Activation bytes per rank of the heaviest stage (see the module docstring)."""
    sbh = work.seq_len * work.micro_batch * shape.hidden
    sp, half = tp > 1, work.act_bytes / 2
    if work.recompute:
        per_layer = work.act_bytes * sbh / (tp if sp else 1)
    else:
        per_layer = half * (34 * sbh / tp if sp else sbh * (10 + 24 / tp))
    in_flight = min(pp, micro)
    logits = 4 * work.seq_len * work.micro_batch * shape.vocab / tp
    return shape.layers // pp * per_layer * in_flight + logits


def tp_calls(shape: Shape, tp: int, pp: int, micro: int) -> int:
    """Tensor-parallel all-reduces per rank and step, on the heaviest stage (with one
    stage: embedding and head too)."""
    if tp == 1:
        return 0
    root = 2 if pp == 1 else 1
    return micro * (shape.layers // pp * shape.tp_collectives_per_layer + root)


def tp_payload(shape: Shape, work: Workload) -> float:
    """Bytes of one tensor-parallel all-reduce: one micro-batch's activations."""
    return work.act_bytes * work.seq_len * work.micro_batch * shape.hidden


def tp_bytes(shape: Shape, work: Workload, tp: int, pp: int, micro: int) -> float:
    """Payload bytes of the tensor-parallel all-reduces per rank and step."""
    return tp_calls(shape, tp, pp, micro) * tp_payload(shape, work)


def pp_bytes(shape: Shape, work: Workload, tp: int, pp: int, micro: int) -> float:
    """Bytes a rank sends and receives point to point per step over one stage boundary
    (the activations forward with the positions, the grads back; a middle stage has
    two boundaries, on two links)."""
    if pp == 1:
        return 0.0
    tokens = work.seq_len * work.micro_batch
    activation = work.act_bytes * tokens * shape.hidden / tp
    positions = 8 * tokens + work.act_bytes * 2 * tokens * shape.hidden // shape.heads
    return micro * (2 * activation + positions)


def pp_messages(pp: int, micro: int) -> int:
    """Point-to-point messages per rank and step over one boundary: per micro-batch the
    activations, the position ids, RoPE's cos and sin, and the grads back."""
    return 4 * micro if pp > 1 else 0


def compute_seconds(shape: Shape, work: Workload, tp: int, pp: int, micro: int,
                    achieved_tflops: float | None) -> float | None:
    """Seconds of model FLOPs per rank and step (``6 * params * tokens``, attention's
    own FLOPs left out), or None without the cluster's achieved TFLOPS."""
    if not achieved_tflops:
        return None
    tokens = micro * work.micro_batch * work.seq_len
    return 6 * shape.params() / (tp * pp) * tokens / (achieved_tflops * 1e12)


def bubble_fraction(pp: int, micro: int) -> float:
    return (pp - 1) / (micro + pp - 1)
