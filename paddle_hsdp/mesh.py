"""Which groups a unit talks to: resolved from the fleet HCG (``mesh=None``)."""

from __future__ import annotations


class HCGMesh:
    """The HSDP groups ``fleet.init`` built, for dense and expert buffers.

    ``dp_size`` is the number of data-parallel ranks a gradient is averaged over: the
    whole dense FSDP group (outer x inner), for expert params too.
    """

    def __init__(self, hcg):
        self.hcg = hcg
        if hcg.get_data_parallel_world_size() > 1:
            raise NotImplementedError(
                "fully_shard with dp_degree > 1 is not supported: put the data-parallel "
                "ranks in sharding_degree and use sharding_configs['fsdp_outer_degree'] "
                "for replication instead."
            )

    def inner(self, is_expert: bool = False):
        return self.hcg.get_fsdp_inner_group(is_expert)

    def outer(self, is_expert: bool = False):
        return self.hcg.get_fsdp_outer_group(is_expert)

    def fsdp_group(self, is_expert: bool = False):
        return self.hcg.get_fsdp_group(is_expert)

    def fsdp_size(self, is_expert: bool = False) -> int:
        return self.hcg.get_fsdp_group(False).nranks

    def mp_rank(self) -> int:
        return self.hcg.get_model_parallel_rank()

    def sep_rank(self) -> int:
        return self.hcg.get_sep_parallel_rank() if self.hcg.get_sep_parallel_world_size() > 1 else 0


def resolve_mesh(mesh):
    if mesh is not None:
        raise NotImplementedError(
            "fully_shard(mesh=...) is not implemented yet: pass mesh=None to use the "
            "groups fleet.init built (sharding_degree, sharding_configs.fsdp_outer_degree)."
        )
    from paddle.distributed.fleet.base import topology

    hcg = topology._HYBRID_PARALLEL_GROUP
    if hcg is None or not hasattr(hcg, "_hsdp_groups"):
        raise RuntimeError(
            "fully_shard(mesh=None) uses the groups fleet.init builds, and fleet has not "
            "been initialised with paddle_hsdp: `import paddle_hsdp`, then call "
            "fleet.init(is_collective=True, strategy=s) with s.hybrid_configs = "
            "{'sharding_degree': N, 'sharding_configs': {'fsdp_outer_degree': O}}."
        )
    return HCGMesh(hcg)
