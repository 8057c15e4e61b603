"""tools/sim_checkpoint.py (issue 51), on a 2-layer Llama-70B so it runs in seconds: every
layout's save tiles every tensor, a load reads each byte once, one file per writing rank,
and HFSDP's index (its optimizer rows by rule) does not grow with the world size
beyond a piece per extra inner segment."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location(
        "sim_checkpoint", os.path.join(ROOT, "tools", "sim_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.LAYERS = 2
    return module


@pytest.mark.parametrize("kind", ["tp8", "hsdp", "hfsdp"])
def test_every_layout_tiles_and_reads_once(sim, kind):
    runs = [sim.simulate(kind, world, sample=2, index_limit=10 ** 6) for world in (128, 1024)]
    for run in runs:
        assert run["tiles"] and run["read_x"] == 1.0, run
        assert run["files"] <= run["world"], run
    if kind == "hfsdp":  # 8 times the ranks (outer 128, inner 1 -> 8): the optimizer
        # rows add no piece (one rule per unit); a unit's parameters, cut at most
        # once more per extra inner segment, add at most one piece per segment
        small, large = runs
        assert 0 <= large["pieces"] - small["pieces"] <= len(sim.units()) * 7, runs
        assert large["metadata_mb"] < small["metadata_mb"] + 0.1, runs
