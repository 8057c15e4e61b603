"""The blockwise int8 quantiser of the compressed outer all-reduce (comm/quantize.py),
one process: the round trip's error bound per block, the same bits as a NumPy
float32 reimplementation, the packed message, the rank-order sum (a piece of it
too), and error feedback (the running sum of what is sent stays within one step's
residual of the running sum of the true values, where without it the error grows)."""

import numpy as np
import pytest

import paddle

from paddle_hsdp import MixedPrecisionPolicy
from paddle_hsdp.comm import quantize
from paddle_hsdp.config.plan import mp_policy_of
from paddle_hsdp.config.schema import ConfigError, load_config

BLOCK = 32


def np_roundtrip(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    grid = x.reshape(-1, block)
    amax = np.abs(grid).max(axis=1)
    scales = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(grid / scales[:, None]), -127, 127)
    return (codes.astype(np.float32) * scales[:, None]).reshape(-1), scales


def values(seed: int, n: int = 20 * BLOCK) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # blocks of very different magnitudes, one all zero, one with a single value
    x = rng.standard_normal(n).astype(np.float32) * np.repeat(
        np.float32(10.0) ** rng.integers(-6, 4, n // BLOCK), BLOCK).astype(np.float32)
    x[:BLOCK] = 0
    x[BLOCK:2 * BLOCK] = 0
    x[BLOCK + 5] = -3.5
    return x


def test_round_trip_error_per_block_and_same_bits_as_numpy():
    for seed in range(5):
        x = values(seed)
        codes, scales = quantize.quantize(paddle.to_tensor(x), BLOCK)
        assert codes.dtype == paddle.int8 and scales.dtype == paddle.float32
        back = quantize.dequantize(codes, scales, BLOCK).numpy()
        want, want_scales = np_roundtrip(x, BLOCK)
        np.testing.assert_array_equal(back, want)
        np.testing.assert_array_equal(scales.numpy(), want_scales)
        err = np.abs(back - x).reshape(-1, BLOCK)
        amax = np.abs(x).reshape(-1, BLOCK).max(axis=1)
        # half a code per value (float32's own rounding of x / scale on top)
        assert (err.max(axis=1) <= amax / 127 * (0.5 + 1e-5)).all(), seed
        assert (back[:BLOCK] == 0).all() and back[BLOCK + 5] == -3.5  # exact at max|x|
        assert np.abs(codes.numpy()).max() == 127


def test_fp8_round_trip_same_bits_as_ml_dtypes():
    """``"fp8"``: codes are x / scale cast to float8 e4m3 (scale = max|x| / 448),
    relative error at most 2^-4 per value above e4m3's subnormals."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for seed in range(5):
        x = values(seed)
        codes, scales = quantize.quantize(paddle.to_tensor(x), BLOCK, "fp8")
        assert codes.dtype == paddle.int8 and codes.shape == [len(x)]
        back = quantize.dequantize(codes, scales, BLOCK, "fp8").numpy()
        grid = x.reshape(-1, BLOCK)
        amax = np.abs(grid).max(axis=1)
        want_scales = np.where(amax > 0, amax / np.float32(448), np.float32(1)) \
            .astype(np.float32)
        scaled = np.clip(grid / want_scales[:, None], -448, 448)
        want = (scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
                * want_scales[:, None]).reshape(-1)
        np.testing.assert_array_equal(scales.numpy(), want_scales)
        np.testing.assert_array_equal(back, want)
        normal = np.abs(x) >= np.repeat(want_scales, BLOCK) * 2.0 ** -6
        assert (np.abs(back - x)[normal] <= 2.0 ** -4 * np.abs(x)[normal] * (1 + 1e-6)).all()
        pieces = quantize.sum_of_messages(quantize.pack(codes, scales), 1, len(x), BLOCK,
                                          3, 70, "fp8").numpy()
        np.testing.assert_array_equal(pieces, want[3:70])


def test_pack_unpack_and_rank_order_sum():
    messages, parts = [], []
    for r in range(3):
        x = values(10 + r)
        codes, scales = quantize.quantize(paddle.to_tensor(x), BLOCK)
        message = quantize.pack(codes, scales)
        assert message.dtype == paddle.int8
        assert message.shape[0] == quantize.packed_numel(len(x), BLOCK) == len(x) + len(x) // 8
        got_codes, got_scales = quantize.unpack(message, len(x))
        np.testing.assert_array_equal(got_codes.numpy(), codes.numpy())
        np.testing.assert_array_equal(got_scales.numpy(), scales.numpy())
        messages.append(message)
        parts.append(np_roundtrip(x, BLOCK)[0])
    gathered = paddle.concat(messages)
    n = len(parts[0])
    total = quantize.sum_of_messages(gathered, 3, n, BLOCK).numpy()
    np.testing.assert_array_equal(total, (parts[0] + parts[1]) + parts[2])
    for lo, hi in ((0, n), (7, 100), (BLOCK, 3 * BLOCK), (n - 5, n)):  # a piece (HFSDP)
        piece = quantize.sum_of_messages(gathered, 3, n, BLOCK, lo, hi).numpy()
        np.testing.assert_array_equal(piece, total[lo:hi])


def test_error_feedback_keeps_the_running_sum_within_one_residual():
    """Over 50 steps of slowly varying grads: with error feedback the sum of what was
    sent differs from the sum of the true values by the last step's residual exactly
    (float32 aside), at most half a code; without it the error grows with the steps."""
    rng = np.random.default_rng(3)
    base = values(4)
    residual = paddle.zeros([len(base)], dtype="float32")
    sent_sum = np.zeros(len(base), np.float64)
    plain_sum = np.zeros(len(base), np.float64)
    true_sum = np.zeros(len(base), np.float64)
    for _ in range(50):
        g = base + np.float32(0.1) * rng.standard_normal(len(base)).astype(np.float32) \
            * np.abs(base)
        x = paddle.to_tensor(g) + residual
        codes, scales = quantize.quantize(x, BLOCK)
        sent = quantize.dequantize(codes, scales, BLOCK)
        residual = x - sent
        sent_sum += sent.numpy()
        plain_sum += np_roundtrip(g, BLOCK)[0]
        true_sum += g
    amax = np.repeat(np.abs(base.reshape(-1, BLOCK)).max(axis=1), BLOCK)
    scale = np.maximum(amax * 1.5 / 127, 1e-30)
    with_feedback = np.abs(true_sum - sent_sum)
    np.testing.assert_allclose(with_feedback, np.abs(residual.numpy()),
                               atol=1e-4 * scale.max() + 1e-6, rtol=1e-3)
    assert (with_feedback <= 0.5 * scale + 1e-5 * np.abs(true_sum)).all()
    without = np.abs(true_sum - plain_sum)
    assert (without / scale).max() > 10 * (with_feedback / scale).max()


def test_the_knob_refuses_bad_values_before_anything_runs():
    with pytest.raises(ValueError, match=r"outer_compress=.*None, 'int8', 'fp8'.*'int4'"):
        MixedPrecisionPolicy(outer_compress="int4")
    with pytest.raises(ValueError, match=r"outer_compress_block=.*>= 8.*4"):
        MixedPrecisionPolicy(outer_compress="int8", outer_compress_block=4)
    with pytest.raises(ValueError, match="outer_compress_block"):
        MixedPrecisionPolicy(outer_compress="int8", outer_compress_block=True)
    with pytest.raises(ConfigError, match="fsdp_outer_compress"):
        load_config({"fsdp_outer_compress": "fp4"})
    with pytest.raises(ConfigError, match="fsdp_outer_compress_block"):
        load_config({"fsdp_outer_compress": "int8", "fsdp_outer_compress_block": 2})
    policy = mp_policy_of(load_config({"fsdp_outer_compress": "int8",
                                       "fsdp_outer_compress_block": 64}))
    assert (policy.outer_compress, policy.outer_compress_block) == ("int8", 64)
    assert policy.param_dtype is None and policy.reduce_dtype is None
    assert mp_policy_of(load_config({})) is None


def test_cost_formula_of_the_int8_outer_sync():
    """topology/cost.py: (O - 1) (S' + 4 S' / B) per rank for a shard of S values
    rounded up to S' (whole blocks), in place of the all-reduce; HFSDP keeps its
    all-gather of the updated float32 pieces."""
    from paddle_hsdp.topology import cost

    def outer_bytes(outer, parts, block):
        b = cost.BufferShape(shard_numel=1000, logical_numel=1990, inner=2, outer=outer,
                             master_bytes=4, gather_bytes=4, reduce_bytes=4, compute_bytes=4,
                             trainable=True, outer_parts=parts, outer_compress_block=block)
        comm = cost.step_comm([cost.UnitShape("u", (b,), True, 1990)])
        return {op: v for (label, op), v in comm.items() if label == "outer"}

    assert outer_bytes(2, 1, 0) == {"all_reduce": 2 * 0.5 * 4000}  # plain, unchanged
    assert outer_bytes(2, 1, 256) == {"all_reduce_int8": 1 * (1024 + 16)}
    assert outer_bytes(4, 1, 100) == {"all_reduce_int8": 3 * (1000 + 40)}
    assert outer_bytes(2, 2, 256) == {"all_reduce_int8": 1040, "all_gather": 0.5 * 4000}


def test_a_compressed_sync_that_would_cost_more_than_float32_is_said_once(caplog):
    """The all-gather form sends (O - 1)(1 + 4/B) bytes a value against the float32 ring's
    8 (O - 1) / O: a quarter at 2 replicas, more from 8 on, said once per degree."""
    from paddle_hsdp.engine.buffer import outer_compress

    assert outer_compress.bytes_against_float32(2, 256) == pytest.approx(0.254, abs=1e-3)
    assert outer_compress.bytes_against_float32(8, 256) > 1
    outer_compress._warned_degrees.discard(8)
    with caplog.at_level("WARNING", logger="paddle_hsdp"):
        outer_compress._warn_if_costlier(2, 256, "int8")
        outer_compress._warn_if_costlier(8, 256, "int8")
        outer_compress._warn_if_costlier(8, 256, "int8")
    said = [r.getMessage() for r in caplog.records if "outer_compress" in r.getMessage()]
    assert len(said) == 1 and "over 8 replicas sends 1.02x" in said[0], said
