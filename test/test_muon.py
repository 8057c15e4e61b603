"""paddle_hsdp.Muon in one process (issue 53): its update of a matrix against the
published algorithm written here in numpy (momentum, Nesterov, quintic Newton-Schulz,
shape scale, decoupled decay), its other parameters against Paddle's AdamW, which
parameters it takes as matrices, and its refusals. Over HSDP shards:
test_collective/test_muon.py."""

from types import SimpleNamespace

import numpy as np
import paddle
import pytest

import paddle_hsdp
from paddle_hsdp.engine.optimizers import refuse_row_sharded_matrices
from paddle_hsdp.optim.muon import MuonParamInfo, default_should_use_muon, muon_param_info

A, B, C = 3.4445, -4.7750, 2.0315


def _numpy_muon(w, grads, lr, beta, wd, steps=5, eps=1e-9, extra=0.2, nesterov=True):
    """The published algorithm on a [in, out] matrix, step by step."""
    m = np.zeros_like(w)
    for g in grads:
        m = beta * m + (1 - beta) * g
        u = (1 - beta) * g + beta * m if nesterov else m
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / max(np.linalg.norm(x), eps)
        for _ in range(steps):
            gram = x @ x.T
            x = A * x + (B * gram + C * gram @ gram) @ x
        o = x.T if u.shape[0] > u.shape[1] else x
        scale = extra * max(1.0, w.shape[1] / w.shape[0]) ** 0.5
        w = w * (1 - lr * wd) - lr * scale * o
    return w


@pytest.mark.parametrize("shape", [[6, 4], [4, 6]], ids=["tall", "wide"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matrix_update_is_the_published_algorithm(float64, shape, nesterov):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(3)]
    p = paddle.create_parameter(shape, "float64",
                                default_initializer=paddle.nn.initializer.Assign(w0))
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=[p], momentum=0.9,
                           weight_decay=0.05, nesterov=nesterov, muon_exclude_patterns=[],
                           ns_matmul_dtype="float64")  # (a bf16-capable GPU's default: bf16)
    for g in grads:
        p.grad = paddle.to_tensor(g)
        opt.step()
        opt.clear_grad()
    expected = _numpy_muon(w0, grads, 0.1, 0.9, 0.05, nesterov=nesterov)
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_three_d_stack_is_a_batch_of_matrices(float64):
    rng = np.random.default_rng(1)
    w0, g = rng.standard_normal([3, 4, 5]), rng.standard_normal([3, 4, 5])
    p = paddle.create_parameter([3, 4, 5], "float64",
                                default_initializer=paddle.nn.initializer.Assign(w0))
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=[p], momentum=0.9, weight_decay=0.0,
                           muon_exclude_patterns=[], ns_matmul_dtype="float64")
    p.grad = paddle.to_tensor(g)
    opt.step()
    expected = np.stack([_numpy_muon(w0[e], [g[e]], 0.1, 0.9, 0.0) for e in range(3)])
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_other_parameters_take_adamw(float64):
    """A bias (1-D) and an excluded matrix (an embedding) step as Paddle's AdamW with
    Muon's adam_* hyperparameters: the same kernel, bit for bit."""
    paddle.seed(3)
    emb, bias = paddle.nn.Embedding(5, 3), paddle.nn.Linear(3, 2).bias
    twin_emb, twin_bias = paddle.nn.Embedding(5, 3), paddle.nn.Linear(3, 2).bias
    twin_emb.weight.set_value(emb.weight)
    twin_bias.set_value(bias)
    params, twins = [emb.weight, bias], [twin_emb.weight, twin_bias]
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=params, weight_decay=0.1,
                           adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-8)
    ref = paddle.optimizer.AdamW(learning_rate=0.1, parameters=twins, weight_decay=0.1,
                                 beta1=0.8, beta2=0.9, epsilon=1e-8)
    assert not any(opt.updates_as_matrix(p) for p in params)
    rng = np.random.default_rng(2)
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            g = rng.standard_normal(p.shape)
            p.grad, q.grad = paddle.to_tensor(g), paddle.to_tensor(g)
        opt.step()
        ref.step()
        opt.clear_grad()
        ref.clear_grad()
    for p, q in zip(params, twins, strict=True):
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def test_which_parameters_are_matrices():
    assert default_should_use_muon("linear_0.w_0", [4, 5])
    assert default_should_use_muon("experts.w", [2, 4, 5])
    assert not default_should_use_muon("linear_0.b_0", [5])
    assert not default_should_use_muon("embedding_0.w_0", [9, 4])  # MUON_EXCLUDE
    assert not default_should_use_muon("Model.LM_HEAD.weight", [4, 9])  # case-insensitive
    p = paddle.create_parameter([4, 5], "float32")
    opt = paddle_hsdp.Muon(parameters=[p], muon_param_info_map={
        p.name: MuonParamInfo(use_muon=False)})
    assert not opt.updates_as_matrix(p)  # the map wins


@pytest.mark.parametrize("kwargs,error,fragment", [
    ({"parameters": None}, ValueError, "parameters"),
    ({"ns_coeff_type": "cubic"}, ValueError, "ns_coeff_type"),
    ({"ns_coeff_type": "custom"}, ValueError, "ns_coeffs"),
    ({"muon_version": 4}, ValueError, "muon_version"),
    ({"tp_mode": "sliced"}, ValueError, "tp_mode"),
    ({"outer_exchange": "ring"}, ValueError, "outer_exchange.*packed.*spread"),
    ({"momentum": 1.0}, ValueError, "momentum"),
])
def test_bad_arguments_are_refused(kwargs, error, fragment):
    p = paddle.create_parameter([4, 5], "float32")
    with pytest.raises(error, match=fragment):
        paddle_hsdp.Muon(**{"parameters": [p], **kwargs})
    with pytest.raises(TypeError, match="parameter groups"):
        paddle_hsdp.Muon(parameters=[{"params": [p]}])


def test_owned_matrices_places_what_muon_updates():
    w, b = paddle.create_parameter([4, 5], "float32"), paddle.create_parameter([5], "float32")
    fn = paddle_hsdp.owned_matrices()
    assert fn(w) == paddle_hsdp.Owned() and fn(b) is None
    assert fn(paddle.create_parameter([2, 4, 5], "float32")) is None  # rows are matrices
    frozen = paddle.create_parameter([4, 5], "float32")
    frozen.stop_gradient = True
    assert fn(frozen) is None  # nothing updates it: its rows cost no owner


def test_one_map_by_structured_names_for_the_placement_and_muon():
    """``lm_head.weight`` is ``linear_N.w_0`` to Paddle: muon_param_info reads the
    structured names, and the same map decides the placement and Muon's update, so a
    matrix owned_matrices leaves in rows is one Muon gives to AdamW. The MoE gate
    pattern does not catch the dense FFN's gate_proj."""
    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lm_head = paddle.nn.Linear(4, 6, bias_attr=False)
            self.gate_proj = paddle.nn.Linear(4, 4, bias_attr=False)

    class Mlp(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.mlp = Net()
            self.mlp.gate = paddle.nn.Linear(4, 2, bias_attr=False)

    net = Mlp()
    info = muon_param_info(net)
    place = paddle_hsdp.owned_matrices(info=info)
    opt = paddle_hsdp.Muon(parameters=net.parameters(), muon_param_info_map=info)
    for p, muon in ((net.mlp.lm_head.weight, False), (net.mlp.gate.weight, False),
                    (net.mlp.gate_proj.weight, True)):
        assert opt.updates_as_matrix(p) is muon and (place(p) is not None) is muon, p.name


class _Slot:
    def __init__(self, whole):
        self.in_one_segment = whole


class _Buffer:
    """What the first step's check reads of a buffer (one parameter, on the device)."""

    def __init__(self, sp):
        self.params, self.host, self.trainable, self.parts = [sp], None, True, 1
        self.outer = SimpleNamespace(nranks=1)  # one replica: nothing to spread over
        self.grads = SimpleNamespace(main_grads=False)
        self.layout = SimpleNamespace(owned=())

    def layout_with_owners(self, owned):
        return None

    def describe(self):
        return "buffer"


class _Sharded:
    def __init__(self, shape, whole, placement=None):
        self.shape, self.slot, self.trainable = shape, _Slot(whole), True
        self.fqn, self.inner_size, self.parts = "w", 2, 1
        self.placement, self.buffer = placement, _Buffer(self)


def _shard(shape, whole, placement=None):
    p = paddle.create_parameter(shape, "float32")
    p._hsdp_sharded_param = _Sharded(shape, whole, placement)
    p._hsdp_sharded_param.shard = p
    return p


def test_cut_matrices_move_or_are_refused():
    """Issue 64: a 2-D parameter cut between segments is moved onto an owner at a
    whole-matrix optimizer's first step (its buffer is returned for that), unless it
    cannot move (here: Shard(0) asked explicitly), which is refused naming the
    placement to use; a 3-D stack (its rows are whole matrices), an owned matrix and a
    parameter it updates elementwise pass as they are."""
    stack, owned, cut = _shard([2, 4, 5], False), _shard([4, 5], True), _shard([4, 5], False)
    bias = _shard([5], False)
    assert refuse_row_sharded_matrices(paddle_hsdp.Muon(parameters=[stack, owned, cut, bias]),
                                       [stack, owned, bias]) == []
    moves = refuse_row_sharded_matrices(paddle_hsdp.Muon(parameters=[cut]), [cut])
    assert moves == [cut._hsdp_sharded_param.buffer]
    asked = _shard([4, 5], False, placement="shard")
    opt = paddle_hsdp.Muon(parameters=[stack, owned, asked, bias])
    with pytest.raises(NotImplementedError, match=r"Shard\(0\).*owned_matrices"):
        refuse_row_sharded_matrices(opt, [asked])
    with pytest.raises(NotImplementedError, match=r"Shard\(0\).*owned_matrices"):
        refuse_row_sharded_matrices(opt, [asked])  # refused again: no verdict was kept
    split = _shard([4, 5], True)
    split.is_distributed, split.split_axis = True, 1
    refuse_row_sharded_matrices(paddle_hsdp.Muon(parameters=[split]), [split])  # it joins

    class OtherMuon(paddle.optimizer.SGD):  # a whole-matrix optimizer that does not
        pass

    with pytest.raises(NotImplementedError, match="tensor-parallel slice"):
        refuse_row_sharded_matrices(OtherMuon(parameters=[split]), [split])
    split.split_axis = None
    with pytest.raises(NotImplementedError, match="without a split_axis"):  # Muon's own,
        refuse_row_sharded_matrices(paddle_hsdp.Muon(parameters=[split]), [split])  # agreed
    opt_excluding = paddle_hsdp.Muon(parameters=[cut], muon_param_info_map={
        cut.name: MuonParamInfo(use_muon=False)})
    refuse_row_sharded_matrices(opt_excluding, [cut])  # AdamW for it: elementwise


def _nesterov_updates(grads, beta):
    """The Nesterov updates Muon orthogonalises, step by step (elementwise: a slice's
    are the slice of the whole matrix's)."""
    m, out = np.zeros_like(grads[0]), []
    for g in grads:
        m = beta * m + (1 - beta) * g
        out.append((1 - beta) * g + beta * m)
    return out


def _tp_slice(shape, axis, rank, w0, grads):
    """A [in, out] matrix's mp slice as Paddle's mp layers mark it, with its grads."""
    part = [np.split(a, 2, axis=axis)[rank] for a in [w0] + grads]
    p = paddle.create_parameter(list(part[0].shape), "float64",
                                default_initializer=paddle.nn.initializer.Assign(part[0]))
    p.is_distributed, p.split_axis = True, axis
    return p, part[1:]


@pytest.mark.parametrize("axis,rank", [(1, 1), (0, 0)], ids=["column-rank1", "row-rank0"])
def test_tensor_parallel_slices_are_joined(float64, monkeypatch, axis, rank):
    """``tp_mode="duplicated"``: the mp slices' updates are joined over the mp group, the
    whole matrix orthogonalised and scaled by its full shape once, by the mp rank it is
    spread to (rank 0 for the one matrix here), this rank's slice kept: the slice of
    the one-process update. A gather to the owner and a scatter from it, at the step's
    end. The other mp rank is played here (its slice's updates, in numpy; as the owner,
    it orthogonalises with this optimizer's own code); the real mp group:
    test_collective/test_muon_owned.py."""
    rng = np.random.default_rng(5)
    w0, grads = rng.standard_normal([4, 6]), [rng.standard_normal([4, 6]) for _ in range(3)]
    p, mine = _tp_slice([4, 6], axis, rank, w0, grads)
    theirs = [np.split(u, 2, axis=axis)[1 - rank]
              for u in _nesterov_updates(grads, 0.9)]
    mp_group = SimpleNamespace(ranks=[0, 1])
    calls, sent = [], []

    def in_rank_order(mine_flat, step):
        parts = [None, None]
        parts[rank], parts[1 - rank] = mine_flat, theirs[step].reshape([-1])
        return parts

    def gather(tensor, gather_list, dst, group, what=None, **_):
        calls.append(("gather", group is mp_group, dst))
        sent.append(tensor.numpy())
        if gather_list is not None:  # this rank owns the matrix
            gather_list.extend(paddle.to_tensor(a) for a in in_rank_order(sent[-1], len(sent) - 1))

    def scatter(out, full, src, group, what=None, **_):
        calls.append(("scatter", group is mp_group, src))
        if full is None:  # the played owner orthogonalises the joined whole
            shape = list(p.shape)
            whole = paddle.concat([paddle.to_tensor(a.reshape(shape)) for a in
                                   in_rank_order(sent[-1], len(sent) - 1)], axis=axis)
            counted = opt.ns_flops  # (the played rank's work is not this rank's)
            full = paddle.concat([x.reshape([-1]) for x in paddle.split(
                opt._orthogonalize(whole, p.name), 2, axis=axis)])
            opt.ns_flops = counted
        paddle.assign(full.reshape([2, -1])[rank], output=out)

    from paddle_hsdp.optim import muon as muon_module
    monkeypatch.setattr(muon_module, "ModelAxes", lambda: SimpleNamespace(
        mp_degree=2, mp_rank=rank, hcg=SimpleNamespace(get_model_parallel_group=lambda: mp_group)))
    monkeypatch.setattr(muon_module.comm, "gather", gather)
    monkeypatch.setattr(muon_module.comm, "scatter", scatter)
    monkeypatch.setattr(muon_module.comm, "is_gloo", lambda group: True)
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=[p], momentum=0.9,
                           weight_decay=0.05, muon_exclude_patterns=[],
                           ns_matmul_dtype="float64")
    flops = []
    for g in mine:
        p.grad = paddle.to_tensor(g)
        opt.step()
        opt.clear_grad()
        flops.append(opt.ns_flops)
    assert calls == [("gather", True, 0), ("scatter", True, 0)] * 3, calls
    # the owner counts the matrix's Newton-Schulz work, the other rank none
    assert (flops[-1] > 0) == (rank == 0), flops
    expected = np.split(_numpy_muon(w0, grads, 0.1, 0.9, 0.05), 2, axis=axis)[rank]
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_joined_matrices_are_spread_by_newton_schulz_work():
    """Issue 65, item 2: the mp-split matrices go to the mp ranks largest work first, each
    to the least loaded (lowest on a tie), alike on every rank."""
    from paddle_hsdp.optim.muon import spread_matrices

    assert spread_matrices([[64, 64], [8, 8], [64, 64], [8, 8]], 2) == [0, 0, 1, 1]
    assert spread_matrices([[4, 6]], 4) == [0]
    assert sorted(spread_matrices([[16, 16]] * 8, 4)) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_blockwise_orthogonalises_each_slice_apart(float64, monkeypatch):
    """``tp_mode="blockwise"`` (Megatron-LM's ``--muon-tp-mode blockwise``): each
    slice is its own matrix, scaled by its own shape, with no communication."""
    from paddle_hsdp.optim import muon as muon_module
    monkeypatch.setattr(muon_module.comm, "all_gather_into", None)  # any call fails
    rng = np.random.default_rng(6)
    w0, grads = rng.standard_normal([4, 6]), [rng.standard_normal([4, 6]) for _ in range(2)]
    p, mine = _tp_slice([4, 6], 1, 0, w0, grads)
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=[p], momentum=0.9,
                           weight_decay=0.05, muon_exclude_patterns=[],
                           ns_matmul_dtype="float64", tp_mode="blockwise")
    for g in mine:
        p.grad = paddle.to_tensor(g)
        opt.step()
        opt.clear_grad()
    expected = _numpy_muon(np.split(w0, 2, axis=1)[0], mine, 0.1, 0.9, 0.05)
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-12)


def _split_shard(held):
    """A TP slice of a [4, 5] matrix as a sharded parameter: held whole here, or a
    0-row shard (another rank of the inner group owns it)."""
    p = paddle.create_parameter([4, 5], "float32")
    p._hsdp_sharded_param = _Sharded([4, 5], True)
    p.is_distributed, p.split_axis = True, 1
    return p if held else SimpleNamespace(
        _hsdp_sharded_param=p._hsdp_sharded_param, is_distributed=True, split_axis=1,
        name=p.name, shape=[0, 5], numel=lambda: 0, dtype=p.dtype)


@pytest.mark.parametrize("theirs,refused", [([[2], [1, 0]], False), ([[2], [0, 1]], True),
                                            ([[3]], True)], ids=["same", "swapped", "count"])
def test_mp_ranks_must_hold_the_same_split_matrices(monkeypatch, theirs, refused):
    """Joining a matrix's slices calls the mp group on the ranks that hold it: an mp
    rank that held other split matrices (or another number) would leave the joins
    waiting, so the first step compares them over the mp group (the other rank played
    here), before any update; blockwise has no joins and calls nothing."""
    from paddle_hsdp.engine import optimizers

    calls = []

    def all_reduce(tensor, group, op=None, what=None, **_):
        calls.append((group, what))
        other = np.array(theirs[len(calls) - 1])
        paddle.assign(paddle.to_tensor(np.maximum(tensor.numpy(), np.concatenate(
            [other, -other]))), output=tensor)

    monkeypatch.setattr(optimizers, "ModelAxes", lambda: SimpleNamespace(
        mp_degree=2, hcg=SimpleNamespace(get_model_parallel_group=lambda: SimpleNamespace(
            ranks=[0, 1]))))
    monkeypatch.setattr(optimizers.comm, "all_reduce", all_reduce)
    shards = [_split_shard(True), _split_shard(False)]
    opt = paddle_hsdp.Muon(parameters=[s for s in shards if hasattr(s, "stop_gradient")])
    if refused:
        with pytest.raises(NotImplementedError, match="hold different tensor-parallel"):
            refuse_row_sharded_matrices(opt, shards)
    else:
        refuse_row_sharded_matrices(opt, shards)
    assert len(calls) == len(theirs), calls
    calls.clear()
    blockwise = paddle_hsdp.Muon(parameters=opt._parameter_list, tp_mode="blockwise")
    refuse_row_sharded_matrices(blockwise, shards)
    assert calls == []


def test_split_matrices_that_cannot_be_joined_are_refused_before_any_update():
    """A split matrix without a ``split_axis`` (which slice it is: unknown), and one
    with a ``split_concat_func`` (joined mp slices lie slice after slice, not as the
    logical matrix it cuts): refused at the first step, nothing updated; blockwise, or
    AdamW, is the way."""
    p = paddle.create_parameter([4, 5], "float32")
    p.is_distributed = True
    opt = paddle_hsdp.Muon(parameters=[p], muon_exclude_patterns=[])
    p.grad = paddle.ones([4, 5])
    with pytest.raises(NotImplementedError, match="without a split_axis"):
        opt.step()  # which slice it is, unknown: nothing to join
    p.split_axis = 1
    before = p.numpy().copy()
    fused = {p.name: MuonParamInfo(split_concat_func=lambda u, ortho: ortho(u))}
    opt = paddle_hsdp.Muon(parameters=[p], muon_exclude_patterns=[], muon_param_info_map=fused)
    p.grad = paddle.ones([4, 5])
    with pytest.raises(NotImplementedError, match="tp_mode='blockwise'"):
        opt.step()
    np.testing.assert_array_equal(p.numpy(), before)
    opt_excluding = paddle_hsdp.Muon(parameters=[p], muon_param_info_map={
        p.name: MuonParamInfo(use_muon=False)})
    opt_excluding.step()  # AdamW for it: elementwise, right on a slice


def test_multi_precision_keeps_a_float32_master(float64):
    """bfloat16 matrices with multi_precision: the update runs on a float32 master
    weight (the published algorithm on it), the parameter is its bfloat16 cast."""
    rng = np.random.default_rng(4)
    w0, g = rng.standard_normal([4, 6]).astype("float32"), rng.standard_normal([4, 6])
    p = paddle.create_parameter([4, 6], "bfloat16",
                                default_initializer=paddle.nn.initializer.Assign(w0))
    start = p.astype("float32").numpy().astype("float64")
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=[p], momentum=0.9, weight_decay=0.0,
                           multi_precision=True, muon_exclude_patterns=[],
                           ns_matmul_dtype="float32")
    p.grad = paddle.to_tensor(g).astype("bfloat16")
    opt.step()
    master = opt._master_weights[p.name]
    assert master.dtype == paddle.float32
    grad = p.grad.astype("float32").numpy().astype("float64")
    np.testing.assert_allclose(master.numpy(), _numpy_muon(start, [grad], 0.1, 0.9, 0.0),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(p.astype("float32").numpy(),
                                  master.astype("bfloat16").astype("float32").numpy())


def test_newton_schulz_flops_are_counted():
    """The counter the benchmark reads: 2 flops a multiply-add, per iteration X X^T,
    A A and B X of the wide orientation (issue 65)."""
    from paddle_hsdp.optim.muon import newton_schulz_flops

    opt = paddle_hsdp.Muon(parameters=[paddle.create_parameter([6, 4], "float32")],
                           ns_steps=3)
    opt.newton_schulz(paddle.rand([6, 4]))  # tall: transposed to 4 x 6
    assert opt.ns_flops == newton_schulz_flops([4, 6], 3) == 3 * 2 * (2 * 16 * 6 + 64)
    opt.newton_schulz(paddle.rand([2, 4, 6]))
    assert opt.ns_flops == 3 * newton_schulz_flops([4, 6], 3)


def _two_matrices(rng):
    """A 4 x 6 and a 5 x 3 float64 parameter, with their starting values."""
    values = rng.standard_normal([4, 6]), rng.standard_normal([5, 3])
    return [(w, paddle.create_parameter(w.shape, "float64",
                                        default_initializer=paddle.nn.initializer.Assign(w)))
            for w in values]


def test_matrices_shared_over_replicas_are_orthogonalised_by_their_replica(float64, monkeypatch):
    """Issue 65: with the engine's shares (engine/optimizers.py,
    share_orthogonalisation_over_replicas), this rank (replica 0 of 2) orthogonalises
    its matrix alone (the flops count it only) and steps the other by what the
    all-gather brings from replica 1 (here zeros: only the decay), each from its own
    slice of the gathered buffer; the momentum of each lives on its replica only."""
    from paddle_hsdp.comm import collectives as comm
    from paddle_hsdp.optim.muon import newton_schulz_flops

    rng = np.random.default_rng(4)
    (w0, mine), (v0, theirs) = _two_matrices(rng)
    group = SimpleNamespace(nranks=2, rank=0, id=-65)
    sent = []

    def all_gather_into(out, send, group, what=None, **_):
        assert out.shape == [2 * send.shape[0]], (out.shape, send.shape)
        sent.append(send.numpy().copy())
        paddle.assign(paddle.concat([send, paddle.zeros_like(send)]), output=out)

    monkeypatch.setattr(comm, "all_gather_into", all_gather_into)
    monkeypatch.setattr(comm, "is_gloo", lambda group: True)  # (a stand-in group)
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=[mine, theirs], momentum=0.9,
                           weight_decay=0.05, muon_exclude_patterns=[], ns_matmul_dtype="float64")
    shares = {mine.name: (group, 0), theirs.name: (group, 1)}
    opt.keep_momentum_on_owners(shares)  # (the engine: once, before any state)
    opt.orthogonalise_over_replicas(shares)
    grad = rng.standard_normal([4, 6])
    mine.grad, theirs.grad = paddle.to_tensor(grad), paddle.to_tensor(rng.standard_normal([5, 3]))
    opt.step()
    assert len(sent) == 1 and sent[0].shape == (24,)  # one all-gather, widest share 4 x 6
    np.testing.assert_allclose(mine.numpy(), _numpy_muon(w0, [grad], 0.1, 0.9, 0.05),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(theirs.numpy(), v0 * (1 - 0.1 * 0.05))
    assert opt.ns_flops == newton_schulz_flops([4, 6], 5)
    assert set(opt._accumulators["moment1"]) == {mine.name}  # replica 1 keeps theirs
    assert opt.holds_state_alone(mine, "moment1") and not opt.holds_state_alone(theirs, "moment1")


def test_share_over_replicas_false_repeats_the_iteration_and_sends_nothing(float64, monkeypatch):
    """``Muon(share_over_replicas=False)``: the engine's shares are ignored, every
    matrix is orthogonalised here (the flops count both) and nothing is all-gathered,
    for a slow outer link where the results' bytes cost more than the iteration."""
    from paddle_hsdp.comm import collectives as comm
    from paddle_hsdp.optim.muon import newton_schulz_flops

    rng = np.random.default_rng(5)
    (w0, mine), (v0, theirs) = _two_matrices(rng)
    group = SimpleNamespace(nranks=2, rank=0, id=-66)
    monkeypatch.setattr(comm, "all_gather_into",
                        lambda *a, **k: pytest.fail("share_over_replicas=False all-gathered"))
    opt = paddle_hsdp.Muon(learning_rate=0.1, parameters=[mine, theirs], momentum=0.9,
                           weight_decay=0.05, muon_exclude_patterns=[], ns_matmul_dtype="float64",
                           share_over_replicas=False)
    opt.orthogonalise_over_replicas({mine.name: (group, 0), theirs.name: (group, 1)})
    grads = rng.standard_normal([4, 6]), rng.standard_normal([5, 3])
    mine.grad, theirs.grad = (paddle.to_tensor(g) for g in grads)
    opt.step()
    np.testing.assert_allclose(mine.numpy(), _numpy_muon(w0, [grads[0]], 0.1, 0.9, 0.05),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(theirs.numpy(), _numpy_muon(v0, [grads[1]], 0.1, 0.9, 0.05),
                               rtol=1e-12, atol=1e-12)
    assert opt.ns_flops == newton_schulz_flops([4, 6], 5) + newton_schulz_flops([3, 5], 5)  # (taller: transposed)
    with pytest.raises(TypeError, match="share_over_replicas"):
        paddle_hsdp.Muon(parameters=[mine], share_over_replicas="no")
