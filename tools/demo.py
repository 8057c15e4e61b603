"""paddle_hsdp demo: fleet.init with fsdp_outer_degree=2 on 4 CPU ranks; every rank
reports its FSDP, inner and outer groups and rank 0 prints them as a table."""

import os

import paddle_hsdp  # noqa: F401  (teaches fleet the fsdp_outer_degree option)

import paddle.distributed as dist
from paddle.distributed import fleet


def init_hsdp(sharding: int, outer: int):
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": sharding,
        "sharding_configs": {"fsdp_outer_degree": outer},
    }
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def group_table(hcg) -> str:
    mine = [hcg.get_fsdp_group().ranks, hcg.get_fsdp_inner_group().ranks,
            hcg.get_fsdp_outer_group().ranks]
    rows = []
    dist.all_gather_object(rows, [dist.get_rank()] + mine)
    header = ("rank", "FSDP group", "inner (shards)", "outer (replicas)")
    cells = [header] + [tuple(str(c) for c in row) for row in sorted(rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] +
                     [line(r) for r in cells[1:]])


def report(text: str) -> None:
    """Rank 0's output: to the file demo.sh shows, or stdout when run by hand."""
    path = os.environ.get("HSDP_DEMO_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")
    else:
        print(text, flush=True)


def main():
    hcg = init_hsdp(sharding=4, outer=2)
    table = group_table(hcg)
    if dist.get_rank() == 0:
        report(f"HSDP layout: fsdp_outer_degree={hcg.get_fsdp_outer_degree()}, "
               f"world size {dist.get_world_size()}\n{table}")
    dist.barrier()


if __name__ == "__main__":
    main()
