"""The cluster planner (paddle_hsdp.config.planner): the alpha-beta ring model by hand, which
link a group is bound by, cluster-file checks, and the recommendation."""

import os

import pytest

from paddle_hsdp import ConfigError
from paddle_hsdp.__main__ import main as cli
from paddle_hsdp.config import planner
from paddle_hsdp.topology import cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = {"name": "t", "nodes": 2, "ranks_per_node": 2,
           "intra_node": {"bandwidth_gbit": 80, "latency_us": 10},
           "inter_node": {"bandwidth_gbit": 0.8, "latency_us": 100},
           "device_memory_gib": 1}


def test_ring_collectives_by_hand():
    link = planner.Link(latency_s=1e-4, bandwidth=1e8)
    # all-gather of 4 MB over 4 ranks: 3 steps, 3/4 of the payload
    assert planner.collective_seconds("all_gather", 4, 4e6, link) == pytest.approx(
        3e-4 + 3e6 / 1e8)
    # all-reduce: twice both; two rings through the same link at once: twice the bytes
    assert planner.collective_seconds("all_reduce", 2, 1e6, link, concurrent=2) == \
        pytest.approx(2e-4 + 2 * 1e6 / 1e8)
    assert planner.collective_seconds("all_reduce", 1, 1e6, link) == 0.0


def test_which_link_a_group_is_bound_by():
    c = planner.load_cluster(CLUSTER)  # 2 machines x 2 ranks
    assert planner._group_link(c, 2, 1) == (c.intra, 1)  # an inner pair on one machine
    assert planner._group_link(c, 4, 1) == (c.inter, 1)  # pure FSDP: one ring across
    assert planner._group_link(c, 2, 2) == (c.inter, 2)  # 2x2 outer: 2 rings at once


def test_step_seconds_of_one_buffer_by_hand():
    c = planner.load_cluster(CLUSTER)
    b = cost.BufferShape(shard_numel=1000, logical_numel=2000, inner=2, outer=2,
                         master_bytes=4, gather_bytes=4, reduce_bytes=4, compute_bytes=4,
                         trainable=True)
    unit = cost.UnitShape("u", (b,), True, 2000)
    t = planner.step_seconds([unit], c, micro_steps=1)
    gather = 2 * (1000 + cost.TAG_NUMEL) * 4
    assert t["inner all_gather"] == pytest.approx(2 * (1e-5 + gather / 2 / 1e10))
    assert t["inner reduce_scatter"] == pytest.approx(1e-5 + 2 * 1000 * 4 / 2 / 1e10)
    assert t["outer all_reduce"] == pytest.approx(2e-4 + 2 * 1000 * 4 / 1e8)


def test_cluster_file_errors_name_the_key():
    bad = dict(CLUSTER, nodes=0, inter_node={"bandwidth_gbit": 1}, extra=1)
    with pytest.raises(ConfigError) as e:
        planner.load_cluster(bad)
    text = str(e.value)
    assert "nodes: expected an int >= 1" in text and "inter_node:" in text
    assert "extra: unknown cluster key" in text


def test_recommendation_prefers_what_fits_then_least_communication():
    c = planner.load_cluster(dict(CLUSTER, device_memory_gib=0.05))
    shape = planner.ModelShape(layers=4, hidden=256, ffn=512, vocab=1000)
    options = planner.evaluate(c, lambda o, i: planner.shape_units(
        shape, i, o, planner.dtype_bytes(None)))
    assert [(o.outer, o.inner) for o in options] == [(1, 4), (2, 2), (4, 1)]
    assert not options[-1].fits  # DDP holds everything
    best, why = planner.recommend(options)
    assert best is options[1] and "least exposed communication" in why  # 2 x 2: gathers stay home
    none, why = planner.recommend([o for o in options if not o.fits])
    assert none is None and "no layout fits" in why


def test_plan_command_with_a_cluster(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(CLUSTER))
    assert cli(["plan", "--cluster", str(path), "--config",
                os.path.join(ROOT, "tools/configs/dense_lm.yaml"),
                "--model", os.path.join(ROOT, "tools/demo.py:build_model")]) == 0
    out = capsys.readouterr().out
    assert "recommended: fsdp_outer_degree=" in out and "DDP (no sharding)" in out
    assert cli(["plan", "--cluster", os.path.join(ROOT, "tools/clusters/2x8_100g.yaml"),
                "--model-shape", "layers=32,hidden=4096,ffn=11008,vocab=32000"]) == 0
    assert "6.74B" in capsys.readouterr().out
    assert cli(["plan", "--cluster", str(path), "--model-shape", "layers=2"]) == 1
    assert "missing hidden" in capsys.readouterr().err


def test_exposed_time_counts_intra_node_collectives_only_without_overlap():
    shape = planner.ModelShape(layers=2, hidden=64, ffn=128, vocab=100)
    units = planner.shape_units(shape, 2, 2, planner.dtype_bytes(None))
    hidden = planner.load_cluster(CLUSTER)
    exposed = planner.load_cluster(dict(CLUSTER, overlap_intra_node=False))
    with_overlap = planner.step_seconds(units, hidden)
    without = planner.step_seconds(units, exposed)
    assert with_overlap["exposed"] == pytest.approx(with_overlap["outer all_reduce"])
    assert without["exposed"] == pytest.approx(sum(v for k, v in without.items()
                                                   if k != "exposed"))


def test_planner_predicts_the_recorded_slow_link_benchmark_within_25_percent():
    """tools/results/: the two-host benchmark at 100 Mbit/s and unthrottled (measured
    2026-11-30); the planner with the calibrated links predicts every variant's step."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import validate_planner

    results = os.path.join(ROOT, "tools", "results")
    assert validate_planner.main(["--limited", os.path.join(results, "two_hosts_100mbit.json"),
                                  "--unlimited",
                                  os.path.join(results, "two_hosts_unlimited.json")]) == 0
