"""Every HSDP group (and every Paddle HCG group) exists, has the right members, works."""

from common import config_from_argv, finish, init_fleet, rank_sum_check

import paddle.distributed as dist

config = config_from_argv()
hcg = init_fleet(config)
rank, outer = dist.get_rank(), config["outer"]
assert hcg.get_fsdp_outer_degree() == outer

for is_expert in (False, True):
    what = "expert" if is_expert else "dense"
    fsdp = hcg.get_fsdp_group(is_expert)
    inner = hcg.get_fsdp_inner_group(is_expert)
    outer_g = hcg.get_fsdp_outer_group(is_expert)
    expected_fsdp = (hcg.get_moe_sharding_parallel_group() if config.get("ep_degree", 1) > 1
                     and is_expert else hcg.get_sharding_parallel_group())
    assert fsdp.ranks == expected_fsdp.ranks, (what, fsdp.ranks)
    # [outer, inner] reshape of the FSDP group, row-major, checked from first principles.
    n_inner = len(fsdp.ranks) // outer
    idx = fsdp.ranks.index(rank)
    assert inner.ranks == fsdp.ranks[(idx // n_inner) * n_inner:(idx // n_inner + 1) * n_inner]
    assert outer_g.ranks == fsdp.ranks[idx % n_inner::n_inner], (what, outer_g.ranks)
    rank_sum_check(fsdp, what + " fsdp")
    rank_sum_check(inner, what + " inner")
    rank_sum_check(outer_g, what + " outer")
    print(f"rank {rank} {what}: fsdp {fsdp.ranks} inner {inner.ranks} outer {outer_g.ranks}")

# Dense and expert outer groups with the same ranks are one communicator.
d, e = hcg.get_fsdp_outer_group(False), hcg.get_fsdp_outer_group(True)
assert (d is e) == (d.ranks == e.ranks), (d.ranks, e.ranks)

# Paddle's own HCG groups were created through the safe path too: they must work.
own = {"dp": hcg.get_data_parallel_group(), "mp": hcg.get_model_parallel_group(),
       "pp": hcg.get_pipe_parallel_group(), "sharding": hcg.get_sharding_parallel_group()}
if config.get("ep_degree", 1) > 1:
    own["ep"] = hcg.get_expert_parallel_group()
    own["moe_sharding"] = hcg.get_moe_sharding_parallel_group()
for name, group in own.items():
    rank_sum_check(group, name)
finish()
