"""paddle_hsdp.topology.fleet and patches.fleet in one process: the strategy option,
validation, group creation."""

import copy
import itertools

import paddle
import pytest
from paddle.distributed import fleet
from paddle.distributed.fleet.base.topology import CommunicateTopology

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.topology import fleet as fleet_ext

MOE_ORDER = ["dp", "pp", "moe_sharding", "ep", "sharding", "sep", "cp", "mp"]


def make_strategy(outer=None, **degrees):
    strategy = fleet.DistributedStrategy()
    configs = dict(degrees)
    if outer is not None:
        configs["sharding_configs"] = {"fsdp_outer_degree": outer}
    strategy.hybrid_configs = configs
    return strategy


# ---------------------------------------------------------------- strategy option
def test_option_default_is_one():
    """A strategy without the option means plain FSDP."""
    assert paddle_hsdp.get_fsdp_outer_degree(fleet.DistributedStrategy()) == 1


def test_option_is_accepted_and_other_keys_still_reach_the_protobuf():
    """fsdp_outer_degree is stored; the other sharding_configs keys are assigned as before."""
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"sharding_degree": 4,
                               "sharding_configs": {"fsdp_outer_degree": 2, "split_param": True}}
    assert paddle_hsdp.get_fsdp_outer_degree(strategy) == 2
    assert strategy.hybrid_configs["sharding_degree"] == 4
    assert strategy.hybrid_configs["sharding_configs"].split_param is True
    clone = copy.deepcopy(strategy)
    assert paddle_hsdp.get_fsdp_outer_degree(clone) == 2
    assert clone.hybrid_configs["sharding_configs"].split_param is True


def test_outer_sharding_option_is_accepted_validated_and_defaults_to_none():
    """fsdp_outer_sharding: "none" by default, "optim" kept aside like fsdp_outer_degree
    (Paddle's protobuf knows neither), anything else refused by fleet.init's check."""
    assert fleet_ext.get_fsdp_outer_sharding(fleet.DistributedStrategy()) == "none"
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"sharding_degree": 4, "sharding_configs": {
        "fsdp_outer_degree": 2, "fsdp_outer_sharding": "optim", "split_param": True}}
    assert fleet_ext.get_fsdp_outer_sharding(copy.deepcopy(strategy)) == "optim"
    assert strategy.hybrid_configs["sharding_configs"].split_param is True
    assert fleet_ext.validate_strategy(strategy) == 2
    strategy.hybrid_configs = {"sharding_degree": 4, "sharding_configs": {
        "fsdp_outer_sharding": "Optim"}}
    with pytest.raises(ValueError, match="'none' .* or 'optim'"):
        fleet_ext.validate_strategy(strategy)


@pytest.mark.parametrize("key,suggested", [("fsdp_outer_degre", "fsdp_outer_degree"),
                                           ("split_parm", "split_param"),
                                           ("bogus_key", None)])
def test_unknown_sharding_configs_keys_are_refused_with_the_closest(key, suggested):
    """Paddle drops unknown sharding_configs keys without a word; a typo of
    fsdp_outer_degree would train as pure FSDP. Refused at the assignment (before
    fleet.init), naming the key, the closest valid one and every valid key; the
    strategy keeps what it had."""
    strategy = make_strategy(2, sharding_degree=4)
    with pytest.raises(ValueError) as err:
        strategy.hybrid_configs = {"sharding_degree": 8, "sharding_configs": {key: 2}}
    msg = str(err.value)
    assert repr(key) in msg and "fsdp_outer_degree" in msg
    assert (f"did you mean {suggested!r}?" in msg) if suggested else ("did you mean" not in msg)
    # Paddle's keys come from its own strategy definition, not a copied table
    paddle_keys = strategy.strategy.hybrid_configs.sharding_configs.DESCRIPTOR.fields_by_name
    assert all(k in msg for k in paddle_keys)
    assert strategy.hybrid_configs["sharding_degree"] == 4
    assert paddle_hsdp.get_fsdp_outer_degree(strategy) == 2


def test_paddle_sharding_keys_keep_their_behaviour_by_dict_and_by_attribute():
    """Paddle's own keys pass through the dict (with ours beside them) and by attribute,
    as PaddleFormers sets them; a misspelt attribute is Paddle's own AttributeError."""
    strategy = make_strategy(sharding_degree=4)
    strategy.hybrid_configs = {"sharding_degree": 4, "sharding_configs": {
        "tensor_fusion": True, "comm_buffer_size_MB": 64}}
    assert strategy.hybrid_configs["sharding_configs"].tensor_fusion is True
    assert strategy.hybrid_configs["sharding_configs"].comm_buffer_size_MB == 64
    strategy.hybrid_configs["sharding_configs"].split_param = True
    assert strategy.hybrid_configs["sharding_configs"].split_param is True
    with pytest.raises(AttributeError, match="split_parm"):
        strategy.hybrid_configs["sharding_configs"].split_parm = True


# ---------------------------------------------------------------- validate_strategy
def test_validate_degree_must_divide_sharding_degree():
    """The error names the value, the group size and the valid choices."""
    with pytest.raises(ValueError) as err:
        fleet_ext.validate_strategy(make_strategy(3, sharding_degree=4))
    msg = str(err.value)
    assert "=3" in msg and "size 4" in msg and "[1, 2, 4]" in msg
    assert fleet_ext.validate_strategy(make_strategy(2, sharding_degree=4)) == 2


def test_validate_ep_needs_moe_order():
    """ep_degree > 1 without moe_sharding/ep in the order is rejected with a usable hint."""
    strategy = make_strategy(2, sharding_degree=8, ep_degree=2, moe_sharding_degree=4)
    with pytest.raises(ValueError, match="hybrid_parallel_order") as err:
        fleet_ext.validate_strategy(strategy)
    assert "'moe_sharding'" in str(err.value) and repr(MOE_ORDER) in str(err.value)
    strategy.hybrid_parallel_order = MOE_ORDER
    assert fleet_ext.validate_strategy(strategy) == 2


def test_validate_moe_sharding_degree_must_be_divisible():
    """The degree must divide moe_sharding_degree too."""
    strategy = make_strategy(2, sharding_degree=6, ep_degree=2, moe_sharding_degree=3)
    strategy.hybrid_parallel_order = MOE_ORDER
    with pytest.raises(ValueError, match=r"expert FSDP group size 3.*\[1, 3\]"):
        fleet_ext.validate_strategy(strategy)


@pytest.mark.parametrize("mode", ["auto", "semi_auto"])
def test_validate_auto_parallel_not_supported(mode):
    """HSDP is manual-hybrid only: degree 2 in auto mode raises, degree 1 is fine."""
    strategy = make_strategy(2, sharding_degree=4)
    setattr(strategy, mode, True)
    with pytest.raises(NotImplementedError, match="auto-parallel"):
        fleet_ext.validate_strategy(strategy)
    strategy = make_strategy(1, sharding_degree=4)
    setattr(strategy, mode, True)
    assert fleet_ext.validate_strategy(strategy) == 1


# ---------------------------------------------------------------- build_hsdp_groups (mocked)
class FakeGroup:
    def __init__(self, ranks, gid):
        self.ranks, self.id, self.nranks = list(ranks), gid, len(ranks)


def own_group(comm_lists, rank, gid):
    return FakeGroup(next(g for g in comm_lists if rank in g), gid)


class FakeHCG:
    """mp2 x sharding4 on 8 ranks, as Paddle's HCG exposes it."""

    def __init__(self, rank):
        self._topo = CommunicateTopology(["data", "pipe", "sharding", "sep", "model"],
                                         [1, 1, 4, 1, 2])
        self._sharding = own_group(self._topo.get_comm_list("sharding"), rank, 100)

    def get_sharding_parallel_group(self):
        return self._sharding


class FakeEPHCG:
    """sharding8 with ep2 x moe_sharding4, as Paddle's EPHybridCommunicateGroup exposes it."""

    def __init__(self, rank):
        self._moe_topo = CommunicateTopology(["pipe", "moe_sharding", "expert"], [1, 4, 2])
        self._dense_topo = None
        self._sharding = FakeGroup(range(8), 100)
        self._moe = own_group(self._moe_topo.get_comm_list("moe_sharding"), rank, 101)

    def merge_inner_comm_list(self, topo, outer_name, inner_name):
        return [list(range(8))]

    def get_sharding_parallel_group(self):
        return self._sharding

    def get_moe_sharding_parallel_group(self):
        return self._moe


@pytest.fixture
def fake_dist(monkeypatch):
    """Record paddle.distributed.new_group calls; simulate a rank; isolate group labels."""
    created, ids = [], itertools.count(1000)

    def new_group(ranks):
        created.append(list(ranks))
        return FakeGroup(ranks, next(ids))

    def build(hcg_cls, rank, outer):
        monkeypatch.setattr(paddle.distributed, "get_rank", lambda: rank)
        created.clear()
        hcg = hcg_cls(rank)
        return hcg, fleet_ext.build_hsdp_groups(hcg, outer)

    monkeypatch.setattr(paddle.distributed, "new_group", new_group)
    monkeypatch.setattr(comm, "_group_labels", {})
    build.created = created
    return build


MP2_ORDER = [[0, 2], [4, 6], [0, 4], [2, 6], [1, 3], [5, 7], [1, 5], [3, 7]]


@pytest.mark.parametrize("rank, inner, outer", [(0, [0, 2], [0, 4]), (3, [1, 3], [3, 7])])
def test_build_creates_every_group_in_one_global_order(fake_dist, rank, inner, outer):
    """Every rank creates all inner/outer groups of all sharding groups in the same order."""
    _, hsdp = fake_dist(FakeHCG, rank, 2)
    assert fake_dist.created == MP2_ORDER
    for is_expert in (False, True):  # no EP: experts use the dense groups
        assert hsdp.inner(rank, is_expert).ranks == inner
        assert hsdp.outer(rank, is_expert).ranks == outer
    assert comm.group_label(hsdp.inner(rank, False)) == "inner"
    assert comm.group_label(hsdp.outer(rank, False)) == "outer"


def test_build_with_ep_shares_outer_group_between_dense_and_expert(fake_dist):
    """Expert groups split moe_sharding; an outer group equal to a dense one is reused."""
    hcg, hsdp = fake_dist(FakeEPHCG, 2, 2)
    assert fake_dist.created == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 4], [1, 5], [2, 6], [3, 7],
                                 [0, 2], [4, 6], [1, 3], [5, 7]]
    assert hsdp.fsdp(False) is hcg.get_sharding_parallel_group()
    assert hsdp.fsdp(True) is hcg.get_moe_sharding_parallel_group()
    assert hsdp.inner(2, False).ranks == [0, 1, 2, 3]
    assert hsdp.inner(2, True).ranks == [0, 2]
    assert hsdp.outer(2, True).ranks == [2, 6]
    assert hsdp.outer(2, True) is hsdp.outer(2, False)  # one communicator
    assert comm.group_label(hsdp.inner(2, True)) == "expert_inner"


def test_build_outer_degree_one_reuses_fsdp_group_as_inner(fake_dist):
    """With outer degree 1 the inner group is the sharding group itself, never re-created."""
    hcg, hsdp = fake_dist(FakeHCG, 0, 1)
    assert hsdp.inner(0, False) is hcg.get_sharding_parallel_group()
    assert [0, 2, 4, 6] not in fake_dist.created
    assert hsdp.outer(0, False).ranks == [0]
    assert hsdp.outer_degree == 1


# ---------------------------------------------------------------- HCG methods
def test_hcg_methods_without_hsdp_groups_raise_clearly():
    """An HCG built without paddle_hsdp imported says how to fix it."""
    class BareHCG:
        global_rank = 0

    for method in fleet_ext.HCG_METHODS.values():
        with pytest.raises(RuntimeError, match="import paddle_hsdp"):
            method(BareHCG())
