"""HSDP inside a tensor-parallel PaddleFormers ``LlamaForCausalLM`` (issues 32, 48), on
CPU ranks: mp2 x sharding S at outer degree O (conftest: mp2 x sharding2 at outer 1
and 2 on 4 ranks, mp2 x sharding3 at outer 3 and 1 on 6, mp2 x sharding1 on 2), against
one process on the global batch (S x PER_RANK rows per micro-batch, the mean over the
S replicas taken after backward as data parallelism takes it: tp_llama.py's [Note: the
Llama's float32 islands]).

Every run trains the tiny Llama of trainer_common's shape (untied, 2 layers) for
STEPS (or LONG_STEPS) steps of MICRO micro-batches with AdamW (or SGD) and global-norm
clipping (active at every step, asserted on the reference's pre-clip norms, which the
run's own must equal), in float64: the loss is computed here from the model's logits in
float64 (PaddleFormers' own criterion casts the logits to float32 first), through
``ParallelCrossEntropy`` on vocabulary-split logits (``tensor_parallel_output=True``:
the ``c_softmax_with_cross_entropy`` CPU shim) or on gathered ones (False: ``c_concat``).
The vocabulary-parallel embedding runs ``c_embedding``'s CPU shim. The reference: the
same model with ``tensor_model_parallel_size=1`` and the full weights, in this process;
the mp model's weights are the mp-rank slices of them (``split_axis``). Checked per
run: every final parameter (this mp rank's slice), the loss and the pre-clip global
norm of every step, within workers/parity.py's float64 bound.

Runs (argv JSON: ``layouts``, each a layout for common.init_fleet plus ``runs``):
``tpo`` / ``concat``: tensor parallelism alone; ``sp_before`` / ``sp_after`` (+
``_fused``): sequence parallelism with Paddle's ``register_sequence_parallel_allreduce_hooks``
called before / after ``fully_shard``; ``sp_callback``: instead of the hooks,
PaddleFormers' ``SPGradSyncCallback`` (its Trainer's route outside sharding stages 2
and 3: a fused all-reduce of the marked grads over mp before the step);
``sp_no_hooks``: sequence parallelism with neither must miss the reference by more than
the bound (the checks can fail); ``clip_sgd`` / ``clip_adamw``: tensor parallelism alone
for LONG_STEPS steps with SGD / AdamW, the clip active at each (issue 48: a clip that
goes wrong after the first steps, an outer degree that is not a power of two).
Each run also prints ``TP_LLAMA_FIGURES {json}`` on every rank (its worst parameter,
loss and norm differences; tools/sweep_tp_layouts.py reads them).
One PaddleFormers criterion forward (float32 logits, as a user's ``model(ids,
labels=...)``) is compared with the reference's, within the float32 bound.
"""

import json
import time

from common import config_from_argv, finish, init_fleet, max_rel, report_over
import parity

import paddle
from paddle.distributed.fleet.utils.sequence_parallel_utils import (
    register_sequence_parallel_allreduce_hooks)

import paddle_hsdp
from paddleformers.trainer.trainer_callback import SPGradSyncCallback
from tp_llama import (CLIP, batches, full_weights, llama, make_opt, mp_slice, reference,
                      set_slices, train)

STEPS, LONG_STEPS, MICRO, PER_RANK = 3, 6, 2, 2
RUNS = {  # name: (tensor_parallel_output, sequence_parallel, hooks, fused, optimizer, steps)
    "tpo": (True, False, None, False, "adamw", STEPS),
    "concat": (False, False, None, False, "adamw", STEPS),
    "sp_before": (True, True, "before", False, "adamw", STEPS),
    "sp_after": (True, True, "after", False, "adamw", STEPS),
    "sp_before_fused": (True, True, "before", True, "adamw", STEPS),
    "sp_after_fused": (True, True, "after", True, "adamw", STEPS),
    "sp_no_hooks": (True, True, None, False, "adamw", STEPS),
    "sp_callback": (True, True, "callback", False, "adamw", STEPS),
    "clip_sgd": (True, False, None, False, "sgd", LONG_STEPS),
    "clip_adamw": (True, False, None, False, "adamw", LONG_STEPS)}


def train_reference(weights, data, replicas, kind):
    ref = reference(weights, data, replicas=replicas, kind=kind)
    assert min(ref["norms"]) > CLIP, ref["norms"]  # clipping is active at every step
    return ref["losses"], ref["norms"], ref["params"]


_references: dict = {}  # (sharding degree, optimizer, steps) -> (data, reference)


def data_and_reference(weights, replicas: int, kind: str, steps: int):
    """The global batch of ``replicas`` sharding ranks and the one-process run on it
    (made once per sharding degree, optimizer and number of steps)."""
    key = (replicas, kind, steps)
    if key not in _references:
        data = batches(replicas * PER_RANK, steps, MICRO)
        _references[key] = data, train_reference(weights, data, replicas, kind)
    return _references[key]


def criterion_loss(model, ids) -> float:
    """PaddleFormers' own loss (labels given: float32 logits, its parallel criterion)."""
    ids = paddle.to_tensor(ids)
    out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
    return float(out[0])


def build_sharded(hcg, weights, tpo, sp, hooks, fused):
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    model = llama(mp, mp_rank, tpo, sp)
    set_slices(model, weights, mp, mp_rank)
    if hooks == "before":
        register_sequence_parallel_allreduce_hooks(model, MICRO, fused)
    for layer in model.model.layers:
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    if sp:  # the shards carry the mark Paddle's helper looks for
        marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", 0)]
        assert marked and all("norm" in n for n in marked), marked
    if hooks == "after":
        register_sequence_parallel_allreduce_hooks(model, MICRO, fused)
    if hooks == "callback":  # PaddleFormers' Trainer's other route: at the optimizer's start
        callback = SPGradSyncCallback(model)
        return model, lambda: callback.on_optimizer_begin(None, None, None)
    return model, None


def train_sharded(hcg, model, data, split_vocab, kind, before_step=None):
    chunk = hcg.get_sharding_parallel_rank()
    return train(model, make_opt(model.parameters(), kind=kind), data,
                 rows=slice(chunk * PER_RANK, (chunk + 1) * PER_RANK),
                 group=hcg.get_sharding_parallel_group(), split_vocab=split_vocab,
                 before_step=before_step, norm_of=paddle_hsdp.last_global_norm)


def compare(hcg, model, got, ref) -> dict:
    (losses, norms), (ref_losses, ref_norms, ref_params) = got, ref
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    full = paddle_hsdp.full_state_dict(model)
    assert set(full) == set(ref_params), set(full) ^ set(ref_params)
    worst = {}
    for name, p in model.named_parameters():
        expected = mp_slice(p, ref_params[name], mp, mp_rank)
        assert list(full[name].shape) == list(expected.shape), name
        worst[name] = max_rel(full[name].numpy(), expected)
    worst["loss"] = max_rel(losses, ref_losses)
    worst["norm"] = max_rel(norms, ref_norms)
    return worst


def run(hcg, layout, name, weights):
    start = time.perf_counter()
    tpo, sp, hooks, fused, kind, steps = RUNS[name]
    sharding = hcg.get_sharding_parallel_world_size()
    data, ref = data_and_reference(weights, sharding, kind, steps)
    model, before_step = build_sharded(hcg, weights, tpo, sp, hooks, fused)
    got = train_sharded(hcg, model, data, split_vocab=tpo, kind=kind, before_step=before_step)
    worst = compare(hcg, model, got, ref)
    label = f"TP_LLAMA {name} sharding={sharding} outer={layout['outer']}"
    params = max(v for k, v in worst.items() if k not in ("loss", "norm"))
    print("TP_LLAMA_FIGURES " + json.dumps(
        {"run": name, "sharding": sharding, "outer": layout["outer"], "mp_rank":
         hcg.get_model_parallel_rank(), "params": params, "loss": worst["loss"],
         "norm": worst["norm"], "loss_abs": max(abs(a - b) for a, b in zip(got[0], ref[0])),
         "min_norm_over_clip": min(ref[1]) / CLIP, "steps": len(ref[1])}), flush=True)
    if name == "sp_no_hooks":  # nothing sums the norms' grads over mp: it must show
        miss = max(worst.values())
        assert miss > 1e3 * parity.bound(), f"{label}: {miss:.2e}, the check cannot fail"
        print(f"{label} misses the reference by {miss:.2e} without the SP hooks "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
        return
    both = report_over(hcg.get_model_parallel_group(), label, worst)  # both mp slices
    active = sum(norm > CLIP for norm in ref[1])  # the reference's; the run's equal them
    print(f"{label}: max rel diff {both:.2e} over the mp ranks (here: parameters "
          f"{params:.2e}, loss {worst['loss']:.2e}, norm {worst['norm']:.2e}); clip active "
          f"at {active}/{len(ref[1])} steps (pre-clip norm >= {min(ref[1]):.3g} > {CLIP}; "
          f"{optimizer_name(kind)}; {time.perf_counter() - start:.1f} s)", flush=True)


def optimizer_name(kind: str) -> str:
    return {"sgd": "SGD", "adamw": "AdamW"}[kind]


def check_criterion(hcg, weights, data):
    """The loss a user gets from ``model(ids, labels=...)`` (PaddleFormers' criterion,
    float32 logits, parallel cross entropy on this rank's vocabulary half)."""
    paddle.set_default_dtype("float32")
    ref = llama()
    ref.set_state_dict({k: v.astype("float32") for k, v in weights.items()})
    model = llama(hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank())
    set_slices(model, weights, hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank())
    ids = data[0][0]
    got, want = criterion_loss(model, ids), criterion_loss(ref, ids)
    print(f"TP_LLAMA criterion loss {got!r} (one process: {want!r})", flush=True)
    parity.report("TP_LLAMA criterion loss (float32)", {"loss": max_rel(got, want)})
    paddle.set_default_dtype("float64")


config = config_from_argv()
parity.set_dtype("float64")
weights = full_weights(7)
for index, layout in enumerate(config["layouts"]):
    hcg = init_fleet(layout)
    assert hcg.get_model_parallel_world_size() == 2
    if index == 0:
        check_criterion(hcg, weights, batches(
            hcg.get_sharding_parallel_world_size() * PER_RANK, STEPS, MICRO))
    for name in layout["runs"]:
        run(hcg, layout, name, weights)
paddle.set_default_dtype("float32")
finish()
