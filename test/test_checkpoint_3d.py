"""The checkpoint format's parallel axes in one process (issue 33): boxes, where a
tensor-parallel slice sits in the full tensor, pipeline names, which rank writes which
piece, what is refused before anything is written, and version 1 checkpoints.
Numbers across real layouts are test_collective/test_checkpoint.py's."""

import json
import os
import shutil

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.base import topology as fleet_topology

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.checkpoint import boxes, plan, save, tp_merge
from paddle_hsdp.checkpoint.format import read_metadata
from paddle_hsdp.engine import saved_names
from paddle_hsdp.topology.placement import ModelAxes

DATA = os.path.join(os.path.dirname(__file__), "data")


class FakeHCG:
    """fleet's HCG as the checkpoint reads it: mp, pp and ep degrees and ranks."""

    def __init__(self, mp=1, mp_rank=0, pp=1, stage=0, ep=1, ep_rank=0):
        self.get_model_parallel_world_size = lambda: mp
        self.get_model_parallel_rank = lambda: mp_rank
        self.get_pipe_parallel_world_size = lambda: pp
        self.get_stage_id = lambda: stage
        self.get_expert_parallel_world_size = lambda: ep
        self.get_expert_parallel_rank = lambda: ep_rank


def column(shape=(4, 3), axis=1):
    p = paddle.create_parameter(list(shape), "float32")
    p.is_distributed, p.split_axis = True, axis
    return p


# ---------------------------------------------------------------- boxes
def test_boxes_intersect_and_tile():
    assert boxes.intersect(((0, 0), (4, 3)), ((2, 1), (4, 4))) == ((2, 1), (2, 2))
    assert boxes.intersect(((0, 0), (2, 3)), ((2, 0), (2, 3))) is None
    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    assert boxes.tiling_error([4, 6], grid) is None
    assert "overlap" in boxes.tiling_error([4, 6], grid + [((1, 0), (2, 3))])
    assert "cover 18 of its 24" in boxes.tiling_error([4, 6], grid[:3])
    assert "outside" in boxes.tiling_error([4, 6], [((3, 0), (2, 6))])
    assert boxes.tiling_error([], [((0,), (1,))]) is None  # a 0-d tensor: one element


# ---------------------------------------------------------------- placement
def test_tensor_parallel_slice_sits_at_its_mp_rank_along_its_split_axis():
    axes = ModelAxes(FakeHCG(mp=2, mp_rank=1))
    place = axes.place(column(), [4, 3])
    assert (place.full_shape, place.offset, place.split) == ([4, 6], [0, 3],
                                                              {"axis": 1, "degree": 2})
    assert place.rows(1, 2) == ([1, 3], [2, 3])  # an inner block of that slice
    rows_split = axes.place(column((4, 3), axis=0), [4, 3])
    assert (rows_split.full_shape, rows_split.rows(2, 2)) == ([8, 3], ([6, 0], [2, 3]))
    replicated = paddle.create_parameter([4], "float32")  # a norm: the same on every mp rank
    assert axes.place(replicated, [4]).full_shape == [4]


def test_a_split_without_its_axis_is_refused_naming_split_axis():
    p = paddle.create_parameter([4, 3], "float32")
    p.is_distributed = True
    with pytest.raises(NotImplementedError, match="split_axis"):
        ModelAxes(FakeHCG(mp=2)).place(p, [4, 3])


def test_local_experts_without_global_indices_carry_their_ep_rank():
    p = paddle.create_parameter([4, 3], "float32")
    p.is_moe_param = True
    axes = ModelAxes(FakeHCG(ep=2, ep_rank=1))
    assert axes.place(p, [4, 3]).tag == "ep1"
    assert axes.place(p, [4, 3], renamed_expert=True).tag == ""


# ---------------------------------------------------------------- pipeline names
class _PipeModel:
    """PaddleFormers' PipelinePretrainedModel as engine/saved_names.py reads it."""

    def get_sequential_name_prefixes(self):
        return {"0": "model", "1": "model.layers.0", "2": "model.layers.1", "3": "lm_head"}

    def get_shardlayer_prefix(self, parts, desc):
        assert parts[1] == "embed_shared"
        return "model"


def test_pipeline_models_use_their_one_process_names():
    rename = saved_names.pipeline_renamer(_PipeModel())
    assert rename("2.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert rename("3.weight") == "lm_head.weight"
    assert rename("1.1.self_attn.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert rename("shared_layers.embed_shared.embed_tokens.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="not a pipeline layer's parameter name"):
        rename("norm.weight")
    assert saved_names.pipeline_renamer(paddle.nn.Linear(2, 2)) is None


# ---------------------------------------------------------------- writers and tiling
class _PlanItem:
    def __init__(self, name, rows, cols, replicas, dtype="float32", offset=0):
        self.name, self.size, self.shape = name, [rows, cols], [rows, cols]
        self.offset, self.dtype, self.replicas = [offset, 0], dtype, plan.Replicas(replicas)


def test_each_distinct_box_is_written_once_and_the_writing_is_balanced_by_bytes():
    """Four outer replicas of one inner rank hold the same blocks: each decides alone
    (same answer) which rows it writes; every row is written once, large tensors are
    cut so the slowest writer carries at most 1.25x the mean; scalars go inline."""
    mib = 1 << 20  # (sizes above plan.MIN_CHUNK_BYTES, 32 MiB, so they are cut)
    shapes = [("embed", 512 * mib // 4096, 1024), ("w1", 48 * mib // 4096, 1024),
              ("norm", 1, 1024), ("w2", 192 * mib // 4096, 1024)]
    writes = {}
    for outer in range(4):
        items = [_PlanItem(n, r, c, (("outer", 4, outer),)) for n, r, c in shapes]
        items.append(_PlanItem("embed/optim/beta1_pow_acc", 1, 1, (("outer", 4, outer),)))
        writes[outer] = plan.plan_writes(items)
    rows = {}
    for outer, ws in writes.items():
        for w in ws:
            rows.setdefault(w.item.name, []).append((w.lo, w.hi))
    for name, r, _ in shapes:
        covered = sorted(rows[name])
        assert covered[0][0] == 0 and covered[-1][1] == r and all(
            a[1] == b[0] for a, b in zip(covered, covered[1:])), (name, covered)
    loads = [sum(plan.item_bytes(w.item) * (w.hi - w.lo) // w.item.size[0] for w in ws)
             for ws in writes.values()]
    assert max(loads) <= 1.25 * sum(loads) / 4, loads
    scalar = [w for ws in writes.values() for w in ws if w.item.name.endswith("pow_acc")]
    assert len(scalar) == 1 and scalar[0].inline
    # a box held on two pipeline stages (a tied layer) is cut alike on both, though
    # each stage's kind holds other items (found in review: cuts came from the kind)
    tied = [_PlanItem("embed", 512 * mib // 4096, 1024, (("outer", 4, 0),))]
    stage0 = plan.assign((("outer", 4),), tied, 4)
    stage1 = plan.assign((("outer", 4),), tied + [
        _PlanItem("w9", 768 * mib // 4096, 1024, (("outer", 4, 0),))], 4)
    assert len(stage0) > 1  # it was cut
    cuts = {(w.lo, w.hi) for w, _ in stage0}
    assert cuts == {(w.lo, w.hi) for w, _ in stage1 if w.item.name == "embed"}, cuts
    # a box only this rank holds is written whole, here
    alone = plan.plan_writes([_PlanItem("x", 3, 2, ())])
    assert [(w.lo, w.hi, w.inline) for w in alone] == [(0, 3, False)]
    # jointly (fault-tolerant groups) the outer axis is not this group's to choose on
    joint = plan.plan_writes([_PlanItem("x", 3, 2, (("outer", 4, 2),))], drop_axes=("outer",))
    assert [(w.lo, w.hi) for w in joint] == [(0, 3)]


def test_overlapping_or_missing_pieces_are_refused_before_publishing():
    def entry(shape, *boxes):
        return {"shape": shape, "pieces": [{"offset": o, "shape": s} for o, s in boxes]}
    collide = {"e": entry([2, 3], ([0, 0], [2, 3]), ([0, 0], [2, 3]))}
    why = save._refusal_to_tile(collide, {"e": {"ep0", "ep1"}})
    assert "global_indices" in why and "e:" in why
    half = {"w": entry([4, 6], ([0, 0], [4, 3]))}
    assert "cover 12 of its 24" in save._refusal_to_tile(half, {})
    # O(n log n): 20,000 row blocks of 8 column slices check in well under a second
    many = entry([20000, 64], *[([r, c * 8], [1, 8]) for r in range(20000) for c in range(8)])
    assert save._refusal_to_tile({"big": many}, {}) is None
    many["pieces"][5]["offset"] = [1, 40]  # overlaps its neighbour row's slice
    assert "overlap" in save._refusal_to_tile({"big": many}, {})


def test_a_save_missing_an_mp_slice_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    """One process that believes it is mp rank 0 of 2 holds half of each split tensor:
    the save must not write a checkpoint of halves."""
    model = paddle.nn.Linear(4, 3)
    model.weight.is_distributed, model.weight.split_axis = True, 1
    monkeypatch.setattr(fleet_topology, "_HYBRID_PARALLEL_GROUP", FakeHCG(mp=2))
    with pytest.raises(checkpoint.CheckpointError, match="(weight|bias): the ranks' pieces do "
                                                         "not tile"):
        checkpoint.save_checkpoint(tmp_path / "ck", model)
    assert not os.path.exists(tmp_path / "ck")


# ---------------------------------------------------------------- a model's own TP merge
class _Fused(paddle.nn.Layer):
    """A model class whose tensor-parallel merge of ``qkv.weight`` interleaves its parts."""

    config = object()

    def __init__(self):
        super().__init__()
        self.qkv = paddle.nn.Linear(2, 4)

    @classmethod
    def _get_tensor_parallel_mappings(cls, config, is_split=False):
        def interleave(slices):  # [q0 k0 | q1 k1] -> [q0 q1 k0 k1]
            halves = [np.split(s, 2, axis=1) for s in slices]
            return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=1)
        return {"qkv.weight": interleave, "qkv.bias": lambda s: np.concatenate(s, axis=0)}


def test_a_model_whose_own_merge_is_not_a_concatenation_is_refused():
    model = _Fused()
    with pytest.raises(NotImplementedError, match="qkv.weight: .*not a concatenation"):
        tp_merge.check_merge_is_concat(model, {"qkv.weight": (1, [2, 4]),
                                               "qkv.bias": (0, [4])}, 2)
    tp_merge.check_merge_is_concat(model, {"qkv.bias": (0, [4])}, 2)


# ---------------------------------------------------------------- version 1
@pytest.mark.parametrize("version", [1, 3])
def test_an_earlier_version_still_loads(tmp_path, version):
    """test/data/checkpoint_v1 was written by the format before tensor-parallel boxes
    (commit be55f2d): rows only; checkpoint_v3 by the format before HFSDP's optimizer
    rows were indexed by rule (commit 320123c): beta powers in the metadata. Each
    loads exactly, optimizer state and LR included."""
    ck = tmp_path / f"v{version}"
    shutil.copytree(os.path.join(DATA, f"checkpoint_v{version}"), ck)
    assert json.load(open(ck / "metadata.json"))["format"] == \
        f"paddle_hsdp-checkpoint/{version}"
    paddle.seed(11)
    model = paddle.nn.Sequential(paddle.nn.Embedding(5, 3), paddle.nn.Linear(3, 4),
                                 paddle.nn.LayerNorm(4))
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters())
    assert checkpoint.load_checkpoint(ck, model, opt) == {"step": 1}
    assert sched.last_epoch == 1
    want = np.load(os.path.join(DATA, f"checkpoint_v{version}_expected.npz"))
    states = {f"{n}/optim/{acc}": table[p.name].numpy() for n, p in model.named_parameters()
              for acc, table in opt._accumulators.items() if p.name in table}
    got = dict({n: p.numpy() for n, p in model.named_parameters()}, **states)
    assert sorted(k.replace(".", "__").replace("/", "--") for k in got) == sorted(want.files)
    for name, value in got.items():
        assert np.array_equal(value, want[name.replace(".", "__").replace("/", "--")]), name
    assert f"paddle_hsdp-checkpoint/{version}" in checkpoint.describe(ck)


def test_describe_shows_the_layout_and_the_bytes(tmp_path, monkeypatch):
    model = paddle.nn.Linear(4, 3)
    checkpoint.save_checkpoint(tmp_path / "ck", model)
    text = checkpoint.describe(tmp_path / "ck")
    assert "paddle_hsdp-checkpoint/4" in text and "mp_degree 1" in text
    assert "written once: 60 of 60 bytes" in text, text
    meta = read_metadata(tmp_path / "ck")
    assert meta["tensors"]["weight"]["pieces"][0]["offset"] == [0, 0]
    assert paddle_hsdp.save_checkpoint is checkpoint.save_checkpoint
