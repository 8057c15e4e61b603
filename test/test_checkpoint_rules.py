"""checkpoint/rules.py (issue 51): HFSDP's optimizer rows placed by rule. One process:
the pieces a rule gives for a box are the segments' rows in the right files (tensor
parallelism on either axis), and rank 0 lays each group's ranks out from the members'
places whatever order an explicit mesh gives them, refusing a clash or a gap."""

import pytest

from paddle_hsdp.checkpoint import rules
from paddle_hsdp.engine.holdings import HeldBuffer
from paddle_hsdp.engine.layout import buffer_layout


def _buffer(shapes, inner, parts, degree=None):
    """A buffer as engine/holdings.py states it (rank 0 of its group, part 0), laid out
    over ``degree`` (engine/layout.py, [Note: the layout degree]; None: ``inner``)."""
    return HeldBuffer(unit=0, index=0, expert=False,
                      layout=buffer_layout(shapes, inner, parts, degree=degree), inner_size=inner,
                      inner_rank=0, parts=parts, part=0, shared_pieces=False,
                      fsdp_group=None, outer_group=None)


def _rule(shapes, inner, parts, base=(0, 0), degree=None):
    buf = _buffer(shapes, inner, parts, degree)
    tensors = {f"p{k}/optim/moment1": [k, list(base)[:len(s)], list(s[1:]), list(s), "float32",
                                      None] for k, s in enumerate(shapes)}
    return rules.rule_of(buf, "dense:0:x", 0, tensors), buf.layout


@pytest.mark.parametrize("inner,parts,degree", [(2, 2, None), (4, 1, None), (1, 4, None),
                                                (3, 2, None), (2, 1, 4), (1, 2, 4)])
def test_a_rules_pieces_tile_a_tensor_and_name_each_segments_rank(inner, parts, degree):
    """(with a layout degree each rank holds several of the fine layout's segments: its
    rows are one box still, named by the merged layout the rule records)"""
    shapes = [[37, 8], [16], [5, 3]]
    rule, layout = _rule(shapes, inner, parts, degree=degree)
    ranks = [100 + r for r in range(inner * parts)]  # laid out [outer, inner]
    ruled = rules.Ruled(rule, ranks, layout)
    for k, shape in enumerate(shapes):
        name = f"p{k}/optim/moment1"
        whole = ((0,) * len(shape), tuple(shape))
        got = rules.pieces(ruled, name, whole)
        assert sum(p["shape"][0] for p in got) == shape[0]
        for p in got:  # each piece is the rows the segment's rank holds
            first = p["offset"][0]
            owners = [j for j in range(inner * parts)
                      if layout.rows_in(k, j) == (first, p["shape"][0])]
            i, q = divmod(owners[0], parts)
            assert p["file"] == f"rank-{ranks[q * inner + i]:05d}.safetensors"
        # a box of rows 3.. of the first tensor: only the pieces that overlap it
        if k == 0:
            part = rules.pieces(ruled, name, ((3, 0), (10, 8)))
            assert all(p["offset"][0] < 13 and p["offset"][0] + p["shape"][0] > 3
                       for p in part) and part


def test_a_tensor_parallel_slice_is_placed_at_its_base():
    rule, layout = _rule([[6, 4]], 2, 1, base=(0, 4))  # the second mp rank's columns
    got = rules.pieces(rules.Ruled(rule, [0, 1], layout), "p0/optim/moment1",
                       ((0, 0), (6, 8)))
    assert [p["offset"] for p in got] == [[0, 4], [3, 4]]
    assert rules.pieces(rules.Ruled(rule, [0, 1], layout), "p0/optim/moment1",
                        ((0, 0), (6, 4))) == []


def test_groups_are_laid_out_from_the_members_places():
    rule, _ = _rule([[8, 2]], 2, 2)
    # ProcessMesh([[3, 1], [2, 0]]): inner groups {1, 3}, {0, 2}; outer {2, 3}, {0, 1}
    places = [["dense:0:x", 0, 0, 0], ["dense:0:x", 1, 0, 2], ["dense:0:x", 0, 1, 1],
              ["dense:0:x", 1, 1, 3]]
    assert rules.grids(places, {"r": rule}) == {"dense:0:x": [0, 2, 1, 3]}
    with pytest.raises(ValueError, match="clashes"):
        rules.grids(places + [["dense:0:x", 1, 1, 5]], {"r": rule})
    with pytest.raises(ValueError, match="1 places unfilled"):
        rules.grids(places[:3], {"r": rule})
    with pytest.raises(ValueError, match="which no rule names"):
        rules.grids([["expert:0:y", 0, 0, 0]], {"r": rule})
