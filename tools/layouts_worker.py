"""One rank of ``tools/validate_planner.py --measure``: a PaddleFormers Llama trained on
4 CPU ranks in three layouts, what each step sends per kind of traffic, and how long
that traffic takes (launched with ``python -m paddle.distributed.launch``).

Layouts (float32, 2 micro-batches of 2 sequences per data-parallel rank and step):
``hsdp2x2`` (sharding 4, outer 2), ``tp2`` (mp 2 x sharding 2), ``pp2``
(``LlamaForCausalLMPipe``, pp 2 x sharding 2, ``train_batch`` 1F1B). Every collective and
point-to-point call a step makes is recorded where gloo runs it
(``ProcessGroupGloo``), with its group; HSDP's are also counted by paddle_hsdp's
counter. After the steps, rank 0's record of the last step is replayed on every rank
(``REPLAYS`` times, each kind's median kept), back to back after one barrier, each call
timed: the step's communication time per kind without the wait for slower ranks that a
training step adds. A calibration
first times each operation the planner fits on its own (all-reduce, all-gather,
reduce-scatter, send) in 2-rank groups at 16 KiB to 4 MiB.

argv: JSON ``{"out": path, "two_hosts": rate or null}``; rank 0 writes the JSON result
there. With ``two_hosts`` the 4 ranks run as 2 hosts x 2 (``tools/two_hosts.py``), every
link limited to that rate (the veth between the hosts and each host's loopback), so
communication, not this machine's 2 cores, sets its time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

import paddle_hsdp  # noqa: F401  (before fleet.init)
import paddle
import paddle.distributed as dist
from paddle.base import core
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology as fleet_topology
from paddle.distributed.parallel import parallel_helper

from paddle_hsdp.comm import collectives as comm

SHAPE = {"layers": 4, "hidden": 256, "ffn": 512, "vocab": 512, "heads": 4, "kv_heads": 2}
SEQ, MICRO_BATCH, MICRO_STEPS, STEPS = 64, 2, 2, 3
REPLAYS = 7  # the step's calls replayed this often; each kind's median time is kept
LAYOUTS = {
    "hsdp2x2": {"sharding_degree": 4, "outer": 2},
    "tp2": {"mp_degree": 2, "sharding_degree": 2, "outer": 1},
    "pp2": {"pp_degree": 2, "sharding_degree": 2, "outer": 1},
}
OPS = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce", "send",
       "recv")
_calls: list = []  # (pg id, op, shape, dtype, HSDP op) of this rank's calls while recording
_recording = [False]
# The paddle_hsdp collective a gloo call serves ("reduce_scatter": its gloo fallback's
# reduces and exchanges), set while paddle_hsdp.comm issues it, on whichever thread
# runs it (gloo calls are never concurrent: comm's thread and the main one take turns).
_hsdp_op = [None]


def _record_calls() -> None:
    """Every gloo call of the ops above, with its process group, while recording."""
    cls = core.ProcessGroupGloo
    for op in OPS:
        original = getattr(cls, op)

        def wrapped(self, *args, __original=original, __op=op, **kwargs):
            if _recording[0]:
                tensors = [a for a in args if isinstance(a, paddle.Tensor)]
                lists = [a for a in args if isinstance(a, list)]
                tensor = tensors[-1] if tensors else lists[0][0]
                _calls.append((id(self), __op, list(tensor.shape), str(tensor.dtype),
                               _hsdp_op[0]))
            return __original(self, *args, **kwargs)

        setattr(cls, op, wrapped)
    issue = comm._issue

    def labelled_issue(op, group, what, call, on_thread=False):
        def run():
            _hsdp_op[0] = op
            try:
                return call()
            finally:
                _hsdp_op[0] = None
        return issue(op, group, what, run, on_thread)

    comm._issue = labelled_issue


def fleet_init(layout: dict):
    """fleet.init for this layout, as a job of its own would run it."""
    fleet_topology._HYBRID_PARALLEL_GROUP = None
    parallel_helper.__parallel_ctx__clz__ = None
    strategy = fleet.DistributedStrategy()
    hybrid = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    hybrid.update({k: v for k, v in layout.items() if k.endswith("_degree")})
    hybrid["sharding_configs"] = {"fsdp_outer_degree": layout["outer"]}
    strategy.hybrid_configs = hybrid
    if layout.get("pp_degree", 1) > 1:
        strategy.pipeline_configs = {"accumulate_steps": MICRO_STEPS,
                                     "micro_batch_size": MICRO_BATCH}
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def llama_config(hcg, tp_output=True):
    from paddleformers.transformers import LlamaConfig

    return LlamaConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"],
                       intermediate_size=SHAPE["ffn"], num_hidden_layers=SHAPE["layers"],
                       num_attention_heads=SHAPE["heads"],
                       num_key_value_heads=SHAPE["kv_heads"], max_position_embeddings=SEQ,
                       max_sequence_length=SEQ, tie_word_embeddings=False,
                       fuse_rms_norm=False,
                       tensor_model_parallel_size=hcg.get_model_parallel_world_size(),
                       tensor_parallel_rank=hcg.get_model_parallel_rank(),
                       tensor_parallel_output=tp_output)


def groups_of(hcg) -> dict:
    """``{id(process group): kind}`` of the groups a step talks over."""
    kinds = {"inner": hcg.get_fsdp_inner_group(), "outer": hcg.get_fsdp_outer_group(),
             "mp": hcg.get_model_parallel_group(), "pp": hcg.get_pipe_parallel_group()}
    out = {}
    for kind, group in kinds.items():
        if group.nranks > 1:
            out.setdefault(id(group.process_group), (kind, group))
    return out


def batches(data_ranks: int, rank_in_data: int):
    rng = np.random.default_rng(3)
    rows = MICRO_BATCH * MICRO_STEPS
    for _ in range(STEPS):
        ids = rng.integers(1, SHAPE["vocab"], size=(data_ranks * rows, SEQ + 1)).astype("int64")
        yield ids[rank_in_data * rows:(rank_in_data + 1) * rows]


def train_layout(name: str, layout: dict) -> dict:
    from paddleformers.transformers import LlamaForCausalLM, LlamaForCausalLMPipe

    hcg = fleet_init(layout)
    paddle.seed(5)
    pipe = layout.get("pp_degree", 1) > 1
    model = (LlamaForCausalLMPipe if pipe else LlamaForCausalLM)(llama_config(hcg))
    blocks = ([m for m in model.run_function if "DecoderLayer" in type(m).__name__] if pipe
              else list(model.model.layers))
    for block in blocks:
        paddle_hsdp.fully_shard(block)
    paddle_hsdp.fully_shard(model)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    if pipe:
        runner, opt = fleet.distributed_model(model), fleet.distributed_optimizer(opt)
    data = batches(hcg.get_sharding_parallel_world_size(), hcg.get_sharding_parallel_rank())
    for step, ids in enumerate(data):
        last = step == STEPS - 1
        if last:
            comm.counter.reset()
            _calls.clear()
            _recording[0] = True
        if pipe:
            runner.train_batch([paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:])], opt)
        else:
            for m in range(MICRO_STEPS):
                part = paddle.to_tensor(ids[m * MICRO_BATCH:(m + 1) * MICRO_BATCH])
                out = model(input_ids=part[:, :-1], labels=part[:, 1:])
                (out[0] / MICRO_STEPS).backward()
            opt.step()
            opt.clear_grad()
        _recording[0] = False
    kinds = groups_of(hcg)
    # a gloo call is filed under the paddle_hsdp op it serves, if any ("inner reduce_scatter"
    # for the fallback's calls), else under its own name
    calls = [(kinds[pg][0], op, shape, dtype, hsdp_op or op)
             for pg, op, shape, dtype, hsdp_op in _calls if pg in kinds]
    hsdp = {k: s for k, s in comm.counter.snapshot().items() if k[0] in ("inner", "outer")}
    counted = {f"{label} {op}": s.wire_bytes for (label, op), s in hsdp.items()}
    calls_by_kind = {f"{label} {op}": s.calls for (label, op), s in hsdp.items()}
    groups = {kind: group for kind, group in kinds.values()}
    rounds = [replay(calls, groups) for _ in range(REPLAYS)]
    seconds = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {"layout": layout, "calls": len(calls), "hsdp_calls": calls_by_kind,
            "hsdp_wire_bytes": counted,
            "pg_payload_bytes": _payload_by_kind(calls), "replayed_s": seconds}


def _payload_by_kind(calls) -> dict:
    out: dict = {}
    for kind, op, shape, dtype, _ in calls:
        nbytes = int(np.prod(shape)) * paddle.to_tensor([], dtype=dtype.replace("paddle.", "")) \
            .element_size()
        key = f"{kind} {op}"
        out[key] = out.get(key, 0) + nbytes
    return out


def _caller(op: str, group, tensor):
    """A function that makes one call of ``op`` on ``group`` with ``tensor`` (every
    buffer it needs made now, so timing it times only the call). Point-to-point: the
    lower rank of the pair sends; ``reduce_scatter``: paddle_hsdp's (gloo's fallback)."""
    me = dist.get_rank()
    if op in ("send", "recv"):
        peer = [r for r in group.ranks if r != me][0]
        return (lambda: dist.send(tensor, dst=peer, group=group)) if me < peer else \
            (lambda: dist.recv(tensor, src=peer, group=group))
    if op.startswith("all_gather"):  # the shard into one flat tensor, as HSDP does
        flat = tensor.reshape([-1])
        gathered = paddle.zeros([group.nranks * flat.shape[0]], dtype=tensor.dtype)
        return lambda: dist.stream.all_gather(gathered, flat, group=group)
    if op == "reduce_scatter":
        shard = paddle.zeros([tensor.shape[0] // group.nranks], dtype=tensor.dtype)
        return lambda: comm.reduce_scatter(shard, tensor, group)
    if op == "reduce":
        return lambda: dist.reduce(tensor, dst=group.ranks[0], group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(tensor, src=group.ranks[0], group=group)
    return lambda: dist.all_reduce(tensor, group=group)


def replay(calls, groups: dict) -> dict:
    """Rank 0's calls of the step, back to back after one barrier of every rank, each
    timed on rank 0: ``{kind op: seconds}``. Every rank replays rank 0's list on its own
    group of the kind (its peers make the same calls: the same layers on the same
    sizes), so each call runs in both pairs at once, as in the calibration."""
    mine = calls if dist.get_rank() == 0 else None
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    todo = [(f"{kind} {served}", _caller(op, groups[kind], paddle.zeros(
        shape, dtype=dtype.replace("paddle.", ""))))
        for kind, op, shape, dtype, served in box[0] if dist.get_rank() in groups[kind].ranks]
    out: dict = {}
    dist.barrier()
    for key, call in todo:
        start = time.perf_counter()
        call()
        out[key] = out.get(key, 0.0) + time.perf_counter() - start
    return out


# float32 elements per rank: 16 KiB to 4 MiB, the range of the step's messages (128 KiB
# activations and tensor-parallel sums to 2 MiB gathers)
CALIBRATION_NUMELS = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)
CALIBRATION_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
WARMUP, ROUNDS, BURST = 2, 5, 8  # untimed calls; rounds of BURST calls back to back


def calibrate(two_hosts: bool) -> list:
    """``[[link, op, payload bytes, seconds per call], ...]`` on rank 0 for each operation
    the planner gives a fit of its own (float32: all-reduce, all-gather into one flat
    tensor, paddle_hsdp's reduce-scatter (its gloo fallback), a send to the pair's other
    rank). ``intra``: ranks 0 and 1 while ranks 2 and 3 run the same in their pair (one
    machine: the replayed steps' pairs share its cores as these do; two hosts: each pair
    on its own host). ``inter`` (two hosts): ranks 0 and 2 alone, the other pair idle
    (the planner multiplies by the rings that cross at once). Calls run back to back as
    the replay runs them (one barrier per round: a barrier per call would time its
    skew); the median round's mean is kept. Payload: the all-gather's gathered bytes,
    the reduce-scatter's input, the others' tensor."""
    me = dist.get_rank()
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][me // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][me % 2]
    links = [("intra", intra, True)] + ([("inter", inter, me in (0, 2))] if two_hosts else [])
    rows = []
    for link, group, active in links:
        for op in CALIBRATION_OPS:
            for numel in CALIBRATION_NUMELS:
                call = _caller(op, group, paddle.zeros([numel], "float32")) if active \
                    else (lambda: None)
                for _ in range(WARMUP):  # the first calls set up gloo's pairs
                    call()
                rounds = []
                for _ in range(ROUNDS):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(BURST):
                        call()
                    rounds.append((time.perf_counter() - start) / BURST)
                payload = 4 * numel * (2 if op == "all_gather" else 1)
                rows.append([link, op, payload, statistics.median(rounds)])
    return rows


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_parallel_env()
    _record_calls()
    two_hosts = cfg.get("two_hosts")
    result = {"shape": SHAPE, "seq": SEQ, "micro_batch": MICRO_BATCH,
              "micro_steps": MICRO_STEPS, "two_hosts": two_hosts,
              "calibration": calibrate(bool(two_hosts)), "layouts": {}}
    for name, layout in LAYOUTS.items():
        result["layouts"][name] = train_layout(name, layout)
        print(f"LAYOUT {name} measured", flush=True)
    if dist.get_rank() == 0:
        with open(cfg["out"], "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
