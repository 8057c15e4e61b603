"""One rank of ``tools/validate_planner.py --measure``: a PaddleFormers Llama trained on
4 CPU ranks in three layouts, what each step sends per kind of traffic, and how long
that traffic takes (launched with ``python -m paddle.distributed.launch``).

Layouts (float32, 2 micro-batches of 2 sequences per data-parallel rank and step):
``hsdp2x2`` (sharding 4, outer 2), ``tp2`` (mp 2 x sharding 2), ``pp2``
(``LlamaForCausalLMPipe``, pp 2 x sharding 2, ``train_batch`` 1F1B). Every collective and
point-to-point call a step makes is recorded where gloo runs it
(``ProcessGroupGloo``), with its group; HSDP's are also counted by paddle_hsdp's
counter. After the steps, rank 0's record of the last step is replayed on every rank,
each call alone after a barrier of its group, and timed: the step's communication time
per kind without the wait for slower ranks that a training step adds. A calibration
first times 2-rank all-reduces of two sizes (the link's latency and bandwidth).

argv: JSON ``{"out": path}``; rank 0 writes the JSON result there.
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
    seconds = replay(calls, {kind: group for kind, group in kinds.values()})
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


def replay(calls, groups: dict) -> dict:
    """Rank 0's calls of the step, each after a barrier of every rank, timed on rank 0:
    ``{kind op: seconds}``. Every rank replays rank 0's list on its own group of the
    kind (its peers make the same calls: the same layers on the same sizes), so each
    call runs in both pairs at once, as in the calibration; point-to-point calls paired
    (the lower rank of the pair sends)."""
    mine = calls if dist.get_rank() == 0 else None
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    out: dict = {}
    for kind, op, shape, dtype, served in box[0]:
        group = groups[kind]
        if dist.get_rank() not in group.ranks:
            continue
        tensor = paddle.zeros(shape, dtype=dtype.replace("paddle.", ""))
        dist.barrier()  # every pair's call at once, as in the calibration
        start = time.perf_counter()
        if op in ("send", "recv"):
            peer = [r for r in group.ranks if r != dist.get_rank()][0]
            if dist.get_rank() < peer:
                dist.send(tensor, dst=peer, group=group)
            else:
                dist.recv(tensor, src=peer, group=group)
        elif op.startswith("all_gather"):  # the shard into one flat tensor, as HSDP does
            gathered = paddle.zeros([group.nranks * int(np.prod(shape))], dtype=tensor.dtype)
            dist.stream.all_gather(gathered, tensor.reshape([-1]), group=group)
        elif op == "reduce":
            dist.reduce(tensor, dst=group.ranks[0], group=group)
        elif op == "broadcast":
            dist.broadcast(tensor, src=group.ranks[0], group=group)
        else:
            dist.all_reduce(tensor, group=group)
        key = f"{kind} {served}"
        out[key] = out.get(key, 0.0) + time.perf_counter() - start
    return out


CALIBRATION_NUMELS = (1, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)


def calibrate() -> list:
    """``[[op, payload bytes, median seconds], ...]`` on rank 0 of float32 all-reduces
    and all-gathers (into one flat tensor) of 4 B to 4 MiB in ranks 0 and 1, while ranks
    2 and 3 run the same in their pair: the replayed steps' groups are pairs too, each
    pair's calls with the other pair's at once, on this machine's cores."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[dist.get_rank() // 2]
    rows = []
    for op in ("all_reduce", "all_gather"):
        for numel in CALIBRATION_NUMELS:
            times = []
            for _ in range(7):
                t = paddle.zeros([numel], "float32")
                out = paddle.zeros([2 * numel], "float32")
                dist.barrier()
                start = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(t, group=group)
                else:
                    dist.stream.all_gather(out, t, group=group)
                times.append(time.perf_counter() - start)
            payload = 4 * numel * (2 if op == "all_gather" else 1)
            rows.append([op, payload, statistics.median(times)])
    return rows


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_parallel_env()
    _record_calls()
    result = {"shape": SHAPE, "seq": SEQ, "micro_batch": MICRO_BATCH,
              "micro_steps": MICRO_STEPS, "calibration": calibrate(), "layouts": {}}
    for name, layout in LAYOUTS.items():
        result["layouts"][name] = train_layout(name, layout)
        print(f"LAYOUT {name} measured", flush=True)
    if dist.get_rank() == 0:
        with open(cfg["out"], "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
