"""How evenly ``owned_matrices()`` spreads whole matrices over a unit's ranks, for real
model shapes, without launching anything: the layout paddle_hsdp computes
(engine/layout.py) for one transformer block per unit (or several), over ``inner``
ranks.

Per unit: the heaviest owner's bytes over the mean (what the unit's collectives pad
to: its bytes against the flat layout's are printed beside it). Over the whole model:
each rank's owned bytes summed over the units (the ties rotate with the unit index),
the heaviest over the mean: the Newton-Schulz work and the optimizer state per rank.
Then, model-wide at inner 8 and at inner x outer = 32 (Muon's first step spreads
owners over inner x outer under plain HSDP, issue 65): the heaviest rank's
Newton-Schulz flops and Muon state (momentum of the matrices it owns) over the mean,
how many ranks of a unit own no matrix, and what a rank's shard of a unit costs
against the flat layout's (the padding every rank holds so that each segment fits its
largest matrix), with whether the engine takes that layout (a shard past twice the
whole buffer keeps the owners in the inner group). With ``--time`` it also times the
layout search at HFSDP's segment counts (inner x outer parts).

    python tools/owner_balance.py                 # Llama-2-7B (MHA), Llama-3-8B (GQA)
    python tools/owner_balance.py --time
"""

from __future__ import annotations

import argparse
import math
import time

import pythonpath  # noqa: F401  (the project on the path, or a one-line error)

from paddle_hsdp.engine.layout import (ALIGN, balanced_rotations, orthogonalisation_work,
                                       owned_loads, owner_balance, segment_layout)
from paddle_hsdp.engine.optimizers import SPREAD_PADDING_MAX
from paddle_hsdp.optim.muon import spread_matrices

# hidden, FFN, key/value width, layers ([in, out] weights, as Paddle lays them out)
MODELS = {"llama2-7b (MHA)": (4096, 11008, 4096, 32),
          "llama3-8b (GQA)": (4096, 14336, 1024, 32)}


def block_shapes(hidden: int, ffn: int, kv: int) -> tuple[list[list[int]], list[bool]]:
    """One decoder block's parameters in order and which of them Muon updates (owned)."""
    shapes = [[hidden], [hidden, hidden], [hidden, kv], [hidden, kv], [hidden, hidden],
              [hidden], [hidden, ffn], [hidden, ffn], [ffn, hidden]]
    return shapes, [len(s) == 2 for s in shapes]


def unit_layouts(model: str, inner: int, blocks_per_unit: int):
    """The layouts of every unit of ``model``'s blocks, and the flat layout's size."""
    hidden, ffn, kv, layers = MODELS[model]
    shapes, owned = block_shapes(hidden, ffn, kv)
    shapes, owned = shapes * blocks_per_unit, owned * blocks_per_unit
    flat = segment_layout(shapes, inner)
    return [segment_layout(shapes, inner, owned, rotation=u)
            for u in range(layers // blocks_per_unit)], flat


def report(model: str, inner: int, blocks_per_unit: int) -> str:
    layouts, flat = unit_layouts(model, inner, blocks_per_unit)
    per_rank = [0] * inner
    for layout in layouts:
        for k, own in enumerate(layout.owned):
            if own:
                per_rank[layout.offsets[k] // layout.segment_numel] += layout.numel(k)
    unit = owner_balance(layouts[0])
    whole = max(per_rank) / (sum(per_rank) / inner)
    return (f"{model:16s} inner {inner}  {blocks_per_unit} block(s)/unit: per unit "
            f"{unit['imbalance']:.2f}x of even, bytes {layouts[0].segment_numel / flat.segment_numel:.2f}x "
            f"the flat layout's; over the model's {len(layouts)} units {whole:.3f}x")


def model_wide(model: str, inner: int, outer: int, blocks_per_unit: int,
               spread: bool = False) -> str:
    """What Muon's first step does with ``model``'s units under plain HSDP ``inner x
    outer`` (engine/optimizers.py): the owners stay in the inner group (the default,
    ``outer_exchange="packed"``), or with ``spread`` (``outer_exchange="spread"``)
    whether they span the outer replicas (not past twice the buffer, nor past
    SPREAD_PADDING_MAX the inner owners' layout), and then
    the heaviest rank's Newton-Schulz work and Muon state over the ideal share (1/(inner
    x outer) of the model's), the ranks of a unit that own no matrix, and a rank's
    shard of a unit against the flat layout's."""
    hidden, ffn, kv, layers = MODELS[model]
    shapes, owned = block_shapes(hidden, ffn, kv)
    shapes, owned = shapes * blocks_per_unit, owned * blocks_per_unit
    units, ranks = layers // blocks_per_unit, inner * outer
    work = [orthogonalisation_work(s) if o else 0 for s, o in zip(shapes, owned)]
    numel = [math.prod(s) if o else 0 for s, o in zip(shapes, owned)]
    inner_layout = segment_layout(shapes, inner, owned)
    spread_layout = segment_layout(shapes, ranks, owned)
    whole = sum(math.prod(s) for s in shapes)
    taken = spread and outer > 1 and spread_layout.segment_numel * outer <= 2 * whole + 2 * outer * ALIGN \
        and spread_layout.total_numel <= SPREAD_PADDING_MAX * inner_layout.total_numel
    if taken:
        rotations = balanced_rotations(
            [owned_loads(spread_layout, work)] * units) or list(range(units))
        layouts = [segment_layout(shapes, ranks, owned, rotation=r) for r in rotations]
        per_rank = lambda w: [sum(owned_loads(lay, w)[j] for lay in layouts)  # noqa: E731
                              for j in range(ranks)]
        shard = spread_layout.segment_numel * outer
    else:  # every replica's owners hold their inner segment's matrices
        layouts = [segment_layout(shapes, inner, owned, rotation=u) for u in range(units)]
        per_rank = lambda w: [sum(owned_loads(lay, w)[j // outer] for lay in layouts)  # noqa: E731
                              for j in range(ranks)]
        shard = inner_layout.segment_numel
    flops, state = per_rank(work), per_rank(numel)
    extra = ""
    if not taken and outer > 1:  # Newton-Schulz and momentum shared over the replicas
        flops, state, extra = shared_over_replicas(
            layouts, shapes, owned, inner, outer,
            units * segment_layout(shapes, inner).segment_numel)
    idle = ranks - len({lay_seg for lay_seg in (
        layouts[0].offsets[k] // layouts[0].segment_numel for k, o in enumerate(owned) if o)}) \
        * (1 if taken else outer)
    flat_shard = segment_layout(shapes, inner).segment_numel
    how = "owners span inner x outer" if taken else (
        "inner owners, Newton-Schulz shared over the replicas" if outer > 1 else "inner owners")
    return (f"{model:16s} {inner} x {outer:<2d} {blocks_per_unit} block(s)/unit, {how}: "
            f"heaviest rank {max(flops) / (sum(work) * units / ranks):.2f}x its share of "
            f"the Newton-Schulz work, {max(state) / (sum(numel) * units / ranks):.2f}x of "
            f"Muon's state; {idle} of {ranks} ranks own no matrix of a unit; a shard "
            f"{shard / flat_shard:.2f}x the flat layout's{extra}")


def shared_over_replicas(layouts, shapes, owned, inner: int, outer: int, flat_shard: int,
                         ) -> tuple[list[int], list[int], str]:
    """Where the owners stay in the inner group: each inner rank's matrices (unit
    order, as the engine lists them) given to the ``outer`` replicas by
    ``spread_matrices`` (engine/optimizers.py, _replica_shares). Newton-Schulz work and
    Muon state per rank (inner-major: the replica given a matrix alone keeps its
    momentum), and the heaviest inner rank's bytes across machines against the flat
    layout's outer all-reduce: its free parameters all-reduced, its matrices' grads
    reduce-scattered packed and the results all-gathered (engine/owned_exchange.py),
    each replica's share padded to the widest."""
    flops, state, heaviest = [], [], 0.0
    for j in range(inner):
        held = [shapes[k] for lay in layouts for k, own in enumerate(owned)
                if own and lay.offsets[k] // lay.segment_numel == j]
        replica = spread_matrices(held, outer)
        share = [[s for s, r in zip(held, replica) if r == o] for o in range(outer)]
        flops.extend(sum(orthogonalisation_work(s) for s in mine) for mine in share)
        state.extend(sum(math.prod(s) for s in mine) for mine in share)
        widest = max(sum(math.prod(s) for s in mine) for mine in share)
        free = sum(lay.rows_in(k, j)[1] * lay.row_numels[k] for lay in layouts
                   for k, own in enumerate(owned) if not own)
        # both on the wire as 2 (O - 1) / O x the elements: the all-reduce's, and the
        # reduce-scatter's and the all-gather's of O x the widest share
        heaviest = max(heaviest, (free + outer * widest) / flat_shard)
    return flops, state, f"; outer bytes {heaviest:.3f}x the flat layout's all-reduce"


def time_search(inner: int, parts: int) -> float:
    """Seconds to lay out one Llama-3-8B block over ``inner * parts`` segments."""
    shapes, owned = block_shapes(*MODELS["llama3-8b (GQA)"][:3])
    start = time.perf_counter()
    segment_layout(shapes, inner * parts, owned)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time", action="store_true",
                    help="also time the layout search at 8 x 16 ... 8 x 1024 segments")
    args = ap.parse_args()
    for model in MODELS:
        for inner in (2, 4, 8):
            for blocks in (1, 2):
                print(report(model, inner, blocks), flush=True)
    for model in MODELS:
        for inner, outer in ((8, 1), (8, 4), (4, 8)):
            for blocks in (1, 2, 4, 8):
                print(model_wide(model, inner, outer, blocks), flush=True)
    if args.time:
        for parts in (16, 128, 1024):
            print(f"layout search, one block over 8 x {parts} segments: "
                  f"{1000 * time_search(8, parts):.0f} ms", flush=True)


if __name__ == "__main__":
    main()
