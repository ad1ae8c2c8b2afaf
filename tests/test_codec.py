import math

import pytest
import torch

from numpy_codec import quantize_vector, unpack_vector
from oscar_export.calibration.fit import feedback_weights
from oscar_export.codec import (
    dequantize,
    fit_lloyd_max_levels,
    normalized_codes,
    pack_codes,
    quantize,
    torch_scale_dtype,
    unpack_codes,
)
from oscar_export.config import OscarConfig, OscarInputError


def _pack(codes, bits):
    codes = torch.tensor(codes + [0] * (-len(codes) % 8), dtype=torch.uint8)
    return pack_codes(codes, bits).tolist()


def test_two_bit_bytes_by_hand():
    assert _pack([1, 2, 3, 0, 0, 0, 0, 0], 2) == [0x39, 0x00]
    assert _pack([3, 3, 3, 3, 0, 1, 2, 3], 2) == [0xFF, 0xE4]


def test_three_bit_bytes_by_hand():
    # word = 1 + 2<<3 + 3<<6 + 4<<9 + 5<<12 + 6<<15 + 7<<18 = 0x1F58D1, little-endian bytes
    assert _pack([1, 2, 3, 4, 5, 6, 7, 0], 3) == [0xD1, 0x58, 0x1F]
    assert _pack([7] * 8, 3) == [0xFF, 0xFF, 0xFF]


def test_four_bit_bytes_by_hand():
    assert _pack([1, 15, 10, 2, 0, 0, 0, 0], 4) == [0xF1, 0x2A, 0x00, 0x00]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (5, 3, 128), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 3, 128 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_unpack_and_dequantize_every_byte_against_the_bit_stream(bits):
    # Every byte value in every position of a packed word, read as the format's little-endian bit stream.
    packed = torch.arange(256 * bits, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(-1, 8 * bits)
    rows = [unpack_vector(row.numpy(), bits, 64) for row in packed]
    assert unpack_codes(packed, bits).tolist() == rows
    levels = (torch.linspace(0, 1, 2**bits) ** 1.3 * (2**bits - 1)).clamp(max=2**bits - 1)  # uneven steps
    scale, zero = torch.rand(len(rows), 2) + 0.5, torch.randn(len(rows), 2)
    got = dequantize(packed, scale.half(), zero.half(), bits, 32, levels)
    want = torch.tensor([[float(zero.half()[r, c // 32]) + float(scale.half()[r, c // 32]) * float(levels[code])
                          for c, code in enumerate(row)] for r, row in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_feedback_codes_are_the_same_in_numpy_and_torch(bits):
    # encode_feedback runs the numpy loop on CPU tensors and the torch loop elsewhere: the same fp32 operations.
    from oscar_export.codec import _feedback_codes, _feedback_codes_numpy, thresholds, uniform_levels

    torch.manual_seed(bits)
    for lead, feedback_lead in (((3, 1), (3, 1)), ((2, 40), (2, 1)), ((7,), ())):
        w = torch.randn(*lead, 64) * 3
        s = (torch.rand(*lead, 2) + 0.05).half().float().repeat_interleave(32, -1)
        s[..., :32].view(-1, 32)[::3] = 0  # a zero scale: its group's codes are 0
        z = (-torch.rand(*lead, 2) * 2).half().float().repeat_interleave(32, -1)
        feedback = (torch.randn(*feedback_lead, 64, 64) * 0.2).triu(1)
        levels = uniform_levels(bits)
        want = _feedback_codes(w.clone(), s, z, levels, thresholds(levels), feedback)
        got = _feedback_codes_numpy(w.clone().numpy(), s.numpy(), z.numpy(), levels.numpy(),
                                    thresholds(levels).numpy(), feedback.expand(*lead, 64, 64).numpy())
        assert torch.equal(torch.from_numpy(got), want), lead
        assert int(want.max()) > 0 and int(want[..., :32].reshape(-1, 32)[::3].max()) == 0


def test_quantize_by_hand_two_bit():
    # Group spans [0, 3]: scale 1, zero 0; u == x, so codes count thresholds 0.5, 1.5, 2.5 strictly exceeded.
    x = torch.tensor([0.0, 3.0, 0.5, 0.51, 1.5, 1.6, 2.5, 2.9] * 4)
    q = quantize(x, bits=2, cluster_dim=32)
    assert q.scale.tolist() == [1.0] and q.zero.tolist() == [0.0]
    assert unpack_codes(q.codes, 2).tolist() == [0, 3, 0, 1, 1, 2, 2, 3] * 4
    assert dequantize(*q, 2, 32).tolist() == [0.0, 3.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0] * 4


def test_quantize_by_hand_clip():
    # Range [-2, 2] clipped to 0.5: [-1, 1]; 4-bit scale = 2/15 in fp16; outside values saturate.
    x = torch.tensor([-2.0, 2.0, 0.0, -1.0] * 8)
    q = quantize(x, bits=4, cluster_dim=32, clip=0.5)
    assert q.zero.tolist() == [-1.0]
    assert q.scale.item() == torch.tensor(2 / 15, dtype=torch.float16).item()
    codes = unpack_codes(q.codes, 4).tolist()
    assert codes[:4] == [0, 15, 8, 0]  # 0.0 -> u = 1/scale = 7.5009 -> above threshold 7.5


def test_constant_group_has_zero_scale_and_zero_codes():
    x = torch.full((2, 64), 0.3)
    q = quantize(x, bits=3, cluster_dim=32)
    assert torch.all(q.scale == 0) and torch.all(q.codes == 0)
    assert torch.equal(dequantize(*q, 3, 32), torch.full((2, 64), torch.tensor(0.3, dtype=torch.float16).item()))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("cluster_dim", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["float16", "float8_e4m3fn"])
def test_matches_numpy_port(bits, cluster_dim, scale_dtype):
    gen = torch.Generator().manual_seed(bits * 1000 + cluster_dim)
    # rows from 1e-3 to 1e2: fp8's subnormal scales (below 2^-6) and its coarse normal ones both appear
    x = torch.randn(6, 128, generator=gen) * torch.logspace(-3, 2, 6).unsqueeze(1)
    for clip in (1.0, 0.93):
        q = quantize(x, bits, cluster_dim, clip, None, scale_dtype)
        assert q.scale.dtype == q.zero.dtype == torch_scale_dtype(scale_dtype)
        for row in range(x.shape[0]):
            codes, scales, zeros = quantize_vector(x[row].numpy(), bits, cluster_dim, clip, None, scale_dtype)
            assert q.codes[row].tolist() == codes.tolist()
            assert q.scale[row].float().tolist() == scales.astype("float32").tolist()
            assert q.zero[row].float().tolist() == zeros.astype("float32").tolist()


def skewed_covariance(d: int, seed: int) -> torch.Tensor:
    """A query covariance whose few leading directions hold most of the energy, as real models' do."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return basis @ torch.diag(torch.logspace(0, -4, d, dtype=torch.float64)) @ basis.T


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("cluster_dim", [32, 64, 128])
def test_feedback_matches_numpy_port(bits, cluster_dim):
    gen = torch.Generator().manual_seed(bits * 100 + cluster_dim)
    x = torch.randn(4, 128, generator=gen) * torch.logspace(-2, 2, 4).unsqueeze(1)
    x[1, :cluster_dim] = 0.25  # a constant group: scale 0, its errors still fed forward
    weights = feedback_weights(skewed_covariance(128, bits)[None], torch.eye(128))[0]
    for clip in (1.0, 0.85):
        q = quantize(x, bits, cluster_dim, clip, feedback=weights)
        plain = quantize(x, bits, cluster_dim, clip)
        assert torch.equal(q.scale, plain.scale) and torch.equal(q.zero, plain.zero)  # only the codes change
        assert not torch.equal(q.codes, plain.codes)
        for row in range(x.shape[0]):
            codes, _, _ = quantize_vector(x[row].numpy(), bits, cluster_dim, clip, feedback=weights.numpy())
            assert q.codes[row].tolist() == codes.tolist()


def test_zero_feedback_is_nearest_rounding():
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    for got, want in zip(quantize(x, 2, 32, 0.9, feedback=torch.zeros(64, 64)), quantize(x, 2, 32, 0.9)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [2, 3])
def test_feedback_cuts_the_error_the_queries_see(bits):
    """What the feedback is for: the query-weighted error (x - x_hat)^T H (x - x_hat) falls well below that of
    nearest rounding, while the plain squared error grows (the error moves where the queries do not read)."""
    h = skewed_covariance(64, 7)
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(8))
    weights = feedback_weights(h[None], torch.eye(64))[0]

    def errors(**kwargs):
        e = (dequantize(*quantize(x, bits, 64, **kwargs), bits, 64) - x).double()
        return float(((e @ h) * e).sum(-1).mean()), float(e.pow(2).sum(-1).mean())

    (seen_fb, plain_fb), (seen, plain) = errors(feedback=weights), errors()
    assert seen_fb < 0.5 * seen and plain_fb > plain


def test_bad_feedback_weights():
    x = torch.randn(2, 64)
    with pytest.raises(OscarInputError, match=r"k_feedback is torch.float32 \(64, 32\): expected float32 \[..., 64, 64\]"):
        quantize(x, 2, 64, feedback=torch.zeros(64, 32))
    with pytest.raises(OscarInputError, match="k_feedback contains inf"):
        quantize(x, 2, 64, feedback=torch.full((64, 64), float("inf")))
    with pytest.raises(OscarInputError, match=r"k_feedback holds 100: expected \|weights\| <= 64"):
        quantize(x, 2, 64, feedback=torch.full((64, 64), 100.0))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("cluster_dim", [32, 64, 128])
def test_error_bound_and_gaussian_error(bits, cluster_dim):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2000, 128, generator=gen)
    q = quantize(x, bits, cluster_dim)
    err = (dequantize(*q, bits, cluster_dim) - x).reshape(2000, -1, cluster_dim)
    groups = x.reshape(2000, -1, cluster_dim)
    lo, hi = groups.amin(-1), groups.amax(-1)
    bound = q.scale.float() / 2 + 2**-11 * (lo.abs() + (hi - lo)) + 1e-6
    assert torch.all(err.abs() <= bound.unsqueeze(-1))
    # Uniform rounding error: RMS = step / sqrt(12), step = E[range] / (L - 1).
    expected = (hi - lo).mean() / (2**bits - 1) / math.sqrt(12)
    rms = err.pow(2).mean().sqrt()
    assert 0.9 * expected < rms < 1.1 * expected


def test_error_grows_with_group_size_and_falls_with_bits():
    x = torch.randn(500, 128, generator=torch.Generator().manual_seed(3))

    def rel(bits, g):
        return float((dequantize(*quantize(x, bits, g), bits, g) - x).norm() / x.norm())

    for g in (32, 64, 128):
        assert rel(2, g) > rel(3, g) > rel(4, g)
    for bits in (2, 3, 4):
        assert rel(bits, 32) < rel(bits, 64) < rel(bits, 128)
    # Gaussian data, cluster_dim 64: theory (E[range] / (L-1) / sqrt(12)) gives 0.46, 0.20, 0.092.
    assert rel(2, 64) < 0.47 and rel(3, 64) < 0.21 and rel(4, 64) < 0.10


def test_lloyd_max_beats_uniform_on_gaussian_data():
    x = torch.randn(4000, 64, generator=torch.Generator().manual_seed(5))
    u = normalized_codes(x, 2, 64, 1.0, "float16")
    levels = fit_lloyd_max_levels(u, 2)
    assert levels[0] > 0 and levels[-1] < 3  # pulled inward, where Gaussian mass is
    uniform = (dequantize(*quantize(x, 2, 64), 2, 64) - x).pow(2).mean()
    lloyd = (dequantize(*quantize(x, 2, 64, levels=levels), 2, 64, levels) - x).pow(2).mean()
    assert lloyd < 0.9 * uniform


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_rejected(bad):
    x = torch.randn(2, 64)
    x[1, 5] = bad
    with pytest.raises(OscarInputError, match="input contains (NaN|inf)"):
        quantize(x, 2, 64)


def test_fp16_overflow_is_rejected_but_float32_scales_work():
    x = torch.tensor([-1e6, 1e6] * 16)
    with pytest.raises(OscarInputError, match="scale_dtype=float16"):
        quantize(x, 2, 32)
    q = quantize(x, 2, 32, scale_dtype="float32")
    assert torch.equal(dequantize(*q, 2, 32), x)


def test_fp8_range_is_checked_before_the_saturating_cast():
    # torch (and ONNX) saturate fp8 at 448 instead of overflowing: the codec refuses what would saturate.
    for x in (torch.tensor([-800.0, 800.0] * 16), torch.full((32,), 500.0) + torch.arange(32) * 0.01):
        with pytest.raises(OscarInputError, match="range of scale_dtype=float8_e4m3fn \\(max 448\\)"):
            quantize(x, 2, 32, scale_dtype="float8_e4m3fn")
    q = quantize(torch.tensor([-448.0, 448.0] * 16), 4, 32, scale_dtype="float8_e4m3fn")
    assert q.zero.float().tolist() == [-448.0] and q.scale.float().tolist() == [60.0]  # 896 / 15 = 59.7 -> 60


def test_bad_arguments():
    with pytest.raises(OscarInputError, match="bits=5"):
        quantize(torch.zeros(64), 5, 32)
    with pytest.raises(OscarInputError, match="not a multiple of cluster_dim=48"):
        quantize(torch.zeros(64), 2, 48)
    with pytest.raises(OscarInputError, match="strictly ascending"):
        quantize(torch.zeros(64), 2, 32, levels=torch.tensor([0.0, 2.0, 1.0, 3.0]))
    with pytest.raises(OscarInputError, match="shape"):
        quantize(torch.zeros(64), 2, 32, levels=torch.tensor([0.0, 3.0]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k_bits=5), "k_bits=5: expected one of"),
        (dict(v_bits=1), "v_bits=1"),
        (dict(cluster_dim=48), "cluster_dim=48"),
        (dict(k_clip=1.5), "k_clip=1.5"),
        (dict(v_clip=float("nan")), "v_clip=nan"),
        (dict(codebook="kmeans"), "codebook='kmeans'"),
        (dict(sink=-1), "sink=-1"),
        (dict(scale_dtype="int8"), "scale_dtype='int8'"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(OscarInputError, match=message):
        OscarConfig(**kwargs)


def test_config_head_dim_and_round_trip():
    with pytest.raises(OscarInputError, match="cluster_dim=128 does not divide head_dim=64"):
        OscarConfig(cluster_dim=128).check_head_dim(64)
    cfg = OscarConfig.reference_recipe()
    assert OscarConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(OscarInputError, match="unknown fields"):
        OscarConfig.from_dict({"bitz": 2})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the codec on the GPU against the CPU")
def test_codec_on_cuda_equals_cpu():
    # CUDA divides by a Python scalar through its reciprocal: the reference must not (bf16 scales showed it).
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4096, 128, generator=gen) * torch.logspace(-3, 3, 4096)[:, None]).half().float()
    for bits, scale_dtype in [(b, s) for b in (2, 3, 4) for s in ("float16", "bfloat16", "float32", "float8_e4m3fn")]:
        got = quantize(x.cuda(), bits, 32, 0.92, None, scale_dtype)
        want = quantize(x, bits, 32, 0.92, None, scale_dtype)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), (bits, scale_dtype)
