"""Fixtures shared by the single-process tier."""

import os
import sys

import paddle
import pytest

# the parity workers' models and bounds (test_collective/workers), shared by both tiers
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "test_collective",
                                "workers"))
import parity  # noqa: E402


@pytest.fixture
def float64():
    """Build this test's models in float64, so its parity checks hold to float64's bound
    (test_collective/workers/parity.py); the default dtype is restored after."""
    before = paddle.get_default_dtype()
    parity.set_dtype("float64")
    yield
    paddle.set_default_dtype(before)
