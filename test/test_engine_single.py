"""The engine's front end in one process: no launch, no distributed init.

The fleet HCG is replaced by a :class:`FakeMesh` whose groups all have one rank (this
process), so every collective in :mod:`paddle_hsdp.comm` short-circuits on
``nranks == 1`` and no process group is needed. These tests therefore check argument
checking, parameter bookkeeping, hooks and grad plumbing; multi-rank numerics are
checked by ``test_collective``.
"""

import os

import numpy as np
import paddle
import pytest

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.comm import gather_tags
from paddle_hsdp.engine.registry import registry as hsdp_registry

from kit import (assert_raises_without_side_effects, batch_ids, models, parity,
                 shard_tinylm, two_linears)

# ---------------------------------------------------------------- misuse


def test_fully_shard_twice_raises_already(fake_mesh):
    """A second fully_shard on the same module is refused before any collective."""
    layer = paddle.nn.Linear(4, 4)
    paddle_hsdp.fully_shard(layer)
    assert_raises_without_side_effects(ValueError, "already", layer)


def test_fully_shard_child_after_parent_raises_bottom_up(fake_mesh):
    """Sharding a child after its parent is refused, with a hint to go bottom-up."""
    model = two_linears()
    paddle_hsdp.fully_shard(model)
    assert_raises_without_side_effects(ValueError, "bottom-up", model[0])


def test_fully_shard_module_without_parameters_raises(fake_mesh):
    """A module with no parameters at all (ReLU) has nothing to shard: ValueError."""
    assert_raises_without_side_effects(ValueError, "no parameters", paddle.nn.ReLU())


def test_root_whose_params_all_sit_in_sharded_children_is_fine(fake_mesh):
    """A root that owns no parameter of its own (all in sharded children) is a valid
    unit with no buffers, and forward/backward still fills every shard's grad."""
    model = two_linears()
    paddle_hsdp.fully_shard(model[0])
    paddle_hsdp.fully_shard(model[1])
    paddle_hsdp.fully_shard(model)
    root = model._hsdp_unit
    assert root.params == [] and root.buffers == []
    model(paddle.randn([5, 4])).sum().backward()
    params = list(model.parameters())
    assert len(params) == 4
    assert all(hasattr(p, "_hsdp_sharded_param") and p.grad is not None for p in params)


def test_non_layer_raises_type_error(fake_mesh):
    """Anything that is not a paddle.nn.Layer is a TypeError."""
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        paddle_hsdp.fully_shard(paddle.randn([2, 2]))
    assert hsdp_registry.units == [] and comm.counter.snapshot() == {}


@pytest.mark.parametrize("arg", ["shard_placement_fn", "mp_policy", "offload_policy",
                                 "ignored_params"])
def test_wrong_argument_types_raise_naming_the_argument(fake_mesh, arg):
    """An argument of the wrong kind raises TypeError naming it, before any collective."""
    assert_raises_without_side_effects(TypeError, arg, paddle.nn.Linear(2, 2),
                                        **{arg: object()})


def test_unsupported_placement_raises(fake_mesh):
    """A placement other than None / Shard(0) / Replicate() raises NotImplementedError
    naming it, before any collective."""
    from paddle.distributed import Shard

    assert_raises_without_side_effects(NotImplementedError, "shard_placement_fn",
                                        paddle.nn.Linear(2, 2),
                                        shard_placement_fn=lambda p: Shard(1))


def test_int_reshard_after_forward_raises(fake_mesh):
    """reshard_after_forward=2 (an int reshard size) is not implemented."""
    assert_raises_without_side_effects(NotImplementedError, "reshard_after_forward",
                                        paddle.nn.Linear(2, 2), reshard_after_forward=2)


def test_without_fleet_init_raises_with_instructions(registry, monkeypatch):
    """With the real resolve_mesh and no HCG, fully_shard says to import paddle_hsdp and
    call fleet.init, before any collective and without touching the module."""
    from paddle.distributed.fleet.base import topology

    monkeypatch.setattr(topology, "_HYBRID_PARALLEL_GROUP", None)
    layer = paddle.nn.Linear(2, 2)
    with pytest.raises(RuntimeError) as info:
        paddle_hsdp.fully_shard(layer)
    assert "fleet.init" in str(info.value) and "import paddle_hsdp" in str(info.value)
    assert not isinstance(layer, paddle_hsdp.FSDPModule)
    assert hsdp_registry.units == [] and hsdp_registry.owner_of == {}
    assert comm.counter.snapshot() == {}


def test_mesh_of_the_wrong_kind_raises(registry):
    """mesh=... that is not a ProcessMesh raises TypeError naming the argument."""
    assert_raises_without_side_effects(TypeError, "mesh", paddle.nn.Linear(2, 2),
                                        mesh=object())


# ---------------------------------------------------------------- parameter bookkeeping


def test_parameters_become_shards_with_the_same_names_and_attributes(fake_mesh):
    """After sharding children and root, parameters() yields one shard param per original
    param with its name, stop_gradient, need_clip and optimize_attr; named_parameters()
    keeps its names; the model is an FSDPModule of a class named FSDP<cls>."""
    model = models.build_model()
    model.blocks[0].fc1.weight.need_clip = False
    model.blocks[1].fc2.bias.optimize_attr = {"learning_rate": 0.5}
    before = list(model.named_parameters())
    attrs = {n: (p.name, p.stop_gradient, p.need_clip, dict(p.optimize_attr))
             for n, p in before}
    originals = {id(p) for _, p in before}

    shard_tinylm(model)

    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before]
    params = list(model.parameters())
    assert len(params) == len(before)
    assert all(hasattr(p, "_hsdp_sharded_param") for p in params)
    assert {id(p._hsdp_sharded_param.full) for p in params} == originals
    for n, p in after:
        assert (p.name, p.stop_gradient, p.need_clip, dict(p.optimize_attr)) == attrs[n], n
    assert attrs["pos"][1] is True  # the frozen table stays frozen
    assert isinstance(model, paddle_hsdp.FSDPModule)
    assert type(model).__name__.startswith("FSDP")
    assert isinstance(model, models.TinyLM)


def test_tied_parameter_has_one_owner_and_the_other_unit_borrows_it(fake_mesh):
    """TinyLM's head reuses embed.weight: the embed unit owns it, the root unit (which
    holds the head) lists the embed unit in ``borrowed``, and both slots name the same
    shard."""
    model = models.build_model()
    tied = model.embed.weight
    shard_tinylm(model)
    embed_unit, root_unit = model.embed._hsdp_unit, model._hsdp_unit
    owners = [u for u in hsdp_registry.units for sp in u.params if sp.full is tied]
    assert owners == [embed_unit]
    assert hsdp_registry.owner_of[id(tied)][0] is embed_unit
    assert root_unit.borrowed == [embed_unit]
    assert all(u.borrowed == [] for u in hsdp_registry.units if u is not root_unit)
    assert model.head.weight is model.embed.weight
    assert model.embed.weight._hsdp_sharded_param.full is tied


# ---------------------------------------------------------------- training


def test_one_rank_training_matches_unsharded_adamw(fake_mesh, float64):
    """3 AdamW steps through the real engine (hooks, reduce-scatter, outer all-reduce,
    optimizer boundary) on the 1-rank fake mesh give the unsharded model's losses and
    params. With one rank every collective is a copy, so this checks the mechanics of
    the hooks and grad plumbing, not multi-rank numerics (test_collective does that).
    The middle step skips Block.extra, which then gets a zero grad on both sides."""
    ref = models.build_model()
    model = shard_tinylm(models.build_model())
    ref_opt = models.make_optimizer(ref, ref.parameters(), None)
    opt = models.make_optimizer(model, model.parameters(), None)
    ref_losses, losses = [], []
    for step, use_extra in enumerate([True, False, True]):
        ids = batch_ids(seed=step)
        for m, o, out in ((ref, ref_opt, ref_losses), (model, opt, losses)):
            loss = models.lm_loss(m, ids, use_extra)
            loss.backward()
            o.step()
            o.clear_grad()
            out.append(float(loss))
    parity.assert_close(losses, ref_losses, "losses")
    full = paddle_hsdp.full_state_dict(model)
    expected = ref.state_dict()  # the unsharded keys, the tied alias head.weight included
    assert set(full) == set(expected)
    for name, value in full.items():
        parity.assert_close(value.numpy(), expected[name].numpy(), name)
    assert all(hasattr(p, "_hsdp_sharded_param") for p in model.parameters())


def test_fifty_models_sharded_trained_and_forgotten_leave_nothing_behind(fake_mesh):
    """Issue 52: ``paddle_hsdp.forget(model)`` releases a sharded model. Sharded, trained
    a step (Adam state, grads) and forgotten, 50 times: the registry is empty, no model
    or unit outlives a collection (the engine holds no reference), the process's memory
    grows by less than 10 MB from the 10th model to the 50th (measured 3.3 MB here;
    20.2 MB when each model is leaked), and a forgotten model has no engine hook."""
    import gc
    import weakref

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    refs, sizes = [], {}
    tables = len(gather_tags._tables)  # the all-gather tags' per-unit tables
    for i in range(50):
        model = shard_tinylm(models.build_model(seed=i))
        opt = models.make_optimizer(model, model.parameters(), None)
        models.lm_loss(model, batch_ids(seed=i), True).backward()
        opt.step()
        opt.clear_grad()
        refs += [weakref.ref(model)] + [weakref.ref(u) for u in hsdp_registry.units]
        per_model = len(hsdp_registry.units)
        paddle_hsdp.forget(model)
        assert not model._forward_pre_hooks and "_hsdp_unit_" not in model.__dict__
        del model, opt
        gc.collect()
        if i in (9, 49):
            sizes[i] = rss()
    assert len(hsdp_registry) == 0 and not hsdp_registry.owner_of
    # the unit indices that tag collectives go on from where the last model's stopped
    assert not hsdp_registry.by_index and hsdp_registry.next_index == 50 * per_model
    assert all(r() is None for r in refs), sum(r() is not None for r in refs)
    assert len(gather_tags._tables) <= tables  # no growth (earlier tests may have left some)
    assert sizes[49] - sizes[9] < 10 << 20, (sizes[49] - sizes[9]) / 2 ** 20
    with pytest.raises(ValueError, match="no fully_shard unit"):
        paddle_hsdp.forget(paddle.nn.Linear(2, 2))


def test_forget_refuses_part_of_a_sharded_model_and_a_live_graph(fake_mesh):
    """forget takes the whole model fully_shard was called on, between steps: a block of
    it, or the model while a forward's graph is alive, is refused and nothing changes."""
    model = shard_tinylm(models.build_model(seed=1))
    units = len(hsdp_registry)
    with pytest.raises(ValueError, match="forget the whole model"):
        paddle_hsdp.forget(model.blocks[0])
    loss = models.lm_loss(model, batch_ids(), True)
    with pytest.raises(RuntimeError, match="a graph still holds its units"):
        paddle_hsdp.forget(model)
    assert len(hsdp_registry) == units
    loss.backward()
    paddle_hsdp.forget(model)
    assert len(hsdp_registry) == 0


def test_memory_report_gathered_after_forward_and_backward(fake_mesh):
    """A child with reshard_after_forward=False still holds its gathered params after
    forward (a resharding child holds none); after backward nothing is gathered."""
    model = models.build_model()
    paddle_hsdp.fully_shard(model.embed)
    paddle_hsdp.fully_shard(model.blocks[0], reshard_after_forward=False)
    paddle_hsdp.fully_shard(model.blocks[1], reshard_after_forward=True)
    paddle_hsdp.fully_shard(model)
    assert paddle_hsdp.memory_report(model)["gathered"] == 0  # sharded at rest

    loss = models.lm_loss(model, batch_ids(), True)
    kept = paddle_hsdp.memory_report(model.blocks[0])
    assert kept["gathered"] > 0 and kept["gathered"] == kept["shard"]  # 1 rank: full == shard
    assert paddle_hsdp.memory_report(model.blocks[1])["gathered"] == 0

    loss.backward()
    held = paddle_hsdp.memory_report(model)
    assert held["gathered"] == 0, held
    assert held["grad"] > 0


def test_forward_that_raised_does_not_break_the_next_root(fake_mesh):
    """After a forward that raised midway, a model sharded next still trains: its
    backward fills the shard grads, reshards, and leaves shard params in the slots."""
    broken = two_linears()
    paddle_hsdp.fully_shard(broken[0])
    paddle_hsdp.fully_shard(broken)
    with pytest.raises(ValueError):
        broken(paddle.randn([2, 5]))  # wrong width: fails inside the first Linear
    model = two_linears()
    paddle_hsdp.fully_shard(model[0])
    paddle_hsdp.fully_shard(model)
    model(paddle.randn([2, 4])).sum().backward()
    assert all(hasattr(p, "_hsdp_sharded_param") for p in model.parameters())
    assert all(sp.shard.grad is not None
               for u in hsdp_registry.units_under(model) for sp in u.params)
    assert paddle_hsdp.memory_report(model)["gathered"] == 0


# ---------------------------------------------------------------- clipping


def test_clip_grad_by_norm_is_refused_at_first_step(fake_mesh):
    """ClipGradByNorm cannot be computed on shards: the first step() raises
    NotImplementedError before any parameter is updated."""
    model = shard_tinylm(models.build_model())
    opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=model.parameters(),
                                 grad_clip=paddle.nn.ClipGradByNorm(1.0))
    models.lm_loss(model, batch_ids(), True).backward()
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    with pytest.raises(NotImplementedError, match="ClipGradByNorm"):
        opt.step()
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), before[n], err_msg=n)


def test_clip_grad_by_global_norm_is_swapped_and_reports_the_norm(fake_mesh, float64):
    """A plain ClipGradByGlobalNorm is replaced by HSDPClipGradByGlobalNorm (same
    clip_norm) at the first step; last_global_norm(opt) is the unsharded model's global
    grad norm, and the clipped update matches the unsharded one."""
    clip = 0.2
    ref = models.build_model()
    model = shard_tinylm(models.build_model())
    ref_opt = models.make_optimizer(ref, ref.parameters(), clip)
    opt = models.make_optimizer(model, model.parameters(), clip)
    assert type(opt._grad_clip) is paddle.nn.ClipGradByGlobalNorm
    assert paddle_hsdp.last_global_norm(opt) is None
    ids = batch_ids()
    models.lm_loss(ref, ids, True).backward()
    ref_norm = models.global_norm(ref)
    assert ref_norm > clip  # the clip is active
    ref_opt.step()
    models.lm_loss(model, ids, True).backward()
    opt.step()
    assert isinstance(opt._grad_clip, paddle_hsdp.HSDPClipGradByGlobalNorm)
    assert opt._grad_clip.clip_norm == clip
    parity.assert_close(paddle_hsdp.last_global_norm(opt), ref_norm, "global norm")
    full = paddle_hsdp.full_state_dict(model)
    for name, p in ref.named_parameters():
        parity.assert_close(full[name].numpy(), p.numpy(), name)


def test_explicit_forward_prefetch_gathers_the_listed_module_early(fake_mesh):
    """block0.set_modules_to_forward_prefetch([block2]) issues block2's all-gather in
    block0's pre-forward: under ZeRO-3 it is in flight while block0 and block1 run (and
    waited for at block2's own pre-forward), and the loss is the same as without."""
    model = shard_tinylm(models.build_model())
    paddle_hsdp.set_zero_stage(model, 3)
    ids = batch_ids()
    plain = float(models.lm_loss(model, ids, True))
    seen = []
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[2]])
    unit2 = model.blocks[2]._hsdp_unit
    hook = model.blocks[1].register_forward_pre_hook(
        lambda layer, inputs: seen.append(unit2._pending_gather is not None))
    prefetched = float(models.lm_loss(model, ids, True))
    hook.remove()
    assert seen == [True]
    assert prefetched == plain
    with pytest.raises(ValueError, match="not an FSDP module"):
        model.blocks[0].set_modules_to_forward_prefetch([paddle.nn.Linear(2, 2)])


# ---------------------------------------------------------------- the segment layout
LAYOUT_SHAPES = [[10, 3], [7], [], [5, 13], [1, 4], [33]]


@pytest.mark.parametrize("inner,parts", [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2),
                                         (2, 3), (3, 2), (4, 4)])
def test_shards_concatenate_to_the_full_buffer_of_whole_row_views(inner, parts):
    """[Note: the segment layout] (engine/layout.py): every rank's flat shard, cut from
    the full parameters, concatenated in rank order is the full buffer, in which each
    parameter is a contiguous view (what lets the all-gather's output serve as the
    parameters); each (inner rank, outer part) holds a box of whole rows of each
    parameter (possibly none), the boxes tile every parameter once, the inner block is
    its parts' boxes in order, and gaps and padding are zeros."""
    from paddle_hsdp.engine.layout import buffer_layout, segment_layout
    assert buffer_layout(LAYOUT_SHAPES, inner, parts) == segment_layout(LAYOUT_SHAPES,
                                                                        inner * parts)
    _gathered_buffer(LAYOUT_SHAPES, inner, parts, None)


@pytest.mark.parametrize("parts", [1, 2])
def test_groups_of_any_size_under_one_layout_degree_hold_one_full_buffer(parts):
    """[Note: the layout degree] (engine/layout.py): with layout degree 4, a group of
    1, 2 or 4 ranks lays these parameters out exactly as a 4-rank group does (a rank of
    a d-rank group holding 4/d segments), so their full flat buffers are identical:
    what lets groups of different sizes line up their shards (ft/degrees.py). Without
    it the 2-rank layout is another one (the [10, 3] parameter starts elsewhere)."""
    from paddle_hsdp.engine.layout import buffer_layout
    four = _gathered_buffer(LAYOUT_SHAPES, 4, parts, None)
    for inner in (1, 2, 4):
        spread = _gathered_buffer(LAYOUT_SHAPES, inner, parts, 4)
        assert spread.shape == four.shape and np.array_equal(spread, four), inner
    assert buffer_layout(LAYOUT_SHAPES, 2, parts).total_numel != four.size
    assert buffer_layout([[5, 6], [10, 3]], 2, 1, degree=4).offsets == (0, 33)
    # owned matrices stay inside one fine segment, so inside one rank's merged one
    owned = [True, False, False, True, False, True]
    merged = buffer_layout(LAYOUT_SHAPES, 2, parts, owned, rotation=1, degree=4)
    fine = buffer_layout(LAYOUT_SHAPES, 4, parts, owned, rotation=1)
    assert merged.offsets == fine.offsets and merged.total_numel == fine.total_numel
    size = merged.segment_numel
    assert all((o // size) == (o + merged.numel(k) - 1) // size
               for k, o in enumerate(merged.offsets) if owned[k])
    for inner, degree in ((2, 3), (4, 2), (2, 0)):
        with pytest.raises(ValueError, match=f"layout degree must be a positive multiple "
                                             f"of the inner degree {inner}, got {degree}"):
            buffer_layout(LAYOUT_SHAPES, inner, parts, degree=degree)


def test_an_expert_inner_group_takes_the_layout_degree_scaled_alike():
    """ft sets the degree for the dense inner group (a 4-rank one laid out as an 8-rank
    one); an expert inner group of 2 is laid out as one of 4, the same scale, so the
    experts' buffers line up across group sizes too; unset, None for both."""
    import types

    from paddle_hsdp.topology.fleet import HSDPGroups
    from paddle_hsdp.topology.mesh import HCGMesh
    sizes = {False: 4, True: 2}
    groups = object.__new__(HSDPGroups)
    groups.layout_degree = None
    hcg = types.SimpleNamespace(
        _hsdp_groups=groups, get_data_parallel_world_size=lambda: 1,
        get_fsdp_inner_group=lambda expert: types.SimpleNamespace(nranks=sizes[expert]))
    mesh = HCGMesh(hcg)
    assert (mesh.layout_degree(False), mesh.layout_degree(True)) == (None, None)
    groups.use_layout_degree(8)
    assert (mesh.layout_degree(False), mesh.layout_degree(True)) == (8, 4)


def _gathered_buffer(shapes, inner, parts, degree):
    """Every rank's flat shard of parameters of ``shapes`` (distinct values), cut as a
    buffer of ``inner`` ranks x ``parts`` laid out at ``degree`` cuts them, checked
    (whole rows, boxes tiling each parameter, zero gaps) and concatenated: the full
    flat buffer an all-gather makes."""
    from paddle_hsdp.engine.layout import ALIGN, buffer_layout
    from paddle_hsdp.engine.param import ShardedParam

    fulls = [np.asarray(np.arange(1, 1 + int(np.prod(s))).reshape(s) + 100 * k, "float32")
             for k, s in enumerate(shapes)]
    params = []
    for full in fulls:
        p = paddle.create_parameter(list(full.shape), "float32")
        p.set_value(full)
        params.append(p)
    layout = buffer_layout(shapes, inner, parts, degree=degree)
    shard_numel = layout.segment_numel * parts
    flats, covered = [], {k: [] for k in range(len(shapes))}
    for i in range(inner):
        flat = np.zeros(shard_numel, dtype="float32")
        for k, p in enumerate(params):
            subs = []
            for q in range(parts):
                sp = ShardedParam(p, f"w{k}", inner, i, parts, q)
                sp.place(layout, k)
                start, count = sp.row_range(sub=True)
                rows = sp.rows_of(p, sub=True).numpy()
                assert list(rows.shape) == sp.shard_shape == [count] + sp.rest
                assert np.array_equal(rows.reshape([count] + sp.rest),
                                      fulls[k].reshape([sp.rows] + sp.rest)[start:start + count])
                flat[sp.slot.flat_offset:sp.slot.flat_offset + sp.sub_numel] = rows.reshape(-1)
                covered[k] += range(start, start + count)
                subs.append((start, count))
            inner_start, inner_count = sp.row_range(sub=False)
            assert sum(c for _, c in subs) == inner_count
            assert inner_count == 0 or subs[0][0] == inner_start or subs[0][1] == 0
        flats.append(flat)
    gathered = np.concatenate(flats)
    end = 0
    for k, full in enumerate(fulls):
        assert covered[k] == list(range(full.shape[0] if full.ndim else 1)), k
        start = layout.offsets[k]
        assert start >= end and start - -(-end // ALIGN) * ALIGN < layout.row_numels[k]
        end = start + full.size
        assert np.array_equal(gathered[start:start + full.size].reshape(full.shape), full)
    for start, stop in layout.gaps():
        assert not gathered[start:stop].any()
    return gathered
