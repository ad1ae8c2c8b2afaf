"""Triton kernels (oscar_export/kernels/triton_oscar.py) against the reference.

On CPU the kernels run through Triton's interpreter, which must be switched on before triton is
first imported. With TRITON_INTERPRET=0 on a CUDA machine they are compiled and run on the GPU,
the inputs moved there and the results compared on the CPU. Codes, scales and zeros must match
bit for bit; attention outputs to fp32 rounding.
"""

import os

import torch

# Compiled on the GPU only when asked for: tests/conftest.py defaults every other test to the interpreter.
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import json
import warnings
from pathlib import Path

import pytest

try:
    import triton  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"triton is not importable ({exc}): the Triton kernel tests need it", allow_module_level=True)

from safetensors.torch import load_file

from oscar_export import OscarConfig, OscarInputError, OscarKVCache
from oscar_export.codec import fit_lloyd_max_levels, quantize
from oscar_export.kernels.triton_oscar import (
    KERNEL_SCALE_DTYPES,
    cache_decode_inputs,
    decode_attention,
    interpreting,
    quantize_pack,
    reference_decode_attention,
    triton_append,
    triton_decode_attend,
)

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
INDEX = json.loads((VECTORS / "index.json").read_text())
CASES = sorted(name for name, meta in INDEX["cases"].items() if meta["config"]["scale_dtype"] in KERNEL_SCALE_DTYPES)
# The quantize kernel rounds to the nearest level; K's error feedback is the reference append's (checked below).
NEAREST = [name for name in CASES if INDEX["cases"][name]["config"].get("k_rounding", "nearest") == "nearest"]
REGIONS = ("sink", "recent", "codes", "scale", "zero")

if DEVICE == "cpu" and not interpreting():  # pragma: no cover - the kernels module was imported before this file set the flag
    pytest.skip("oscar_export.kernels.triton_oscar was imported without TRITON_INTERPRET=1: its kernels "
                "are compiled for a GPU, not interpreted on CPU", allow_module_level=True)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype.is_floating_point:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        got, want = got.view(ints), want.view(ints)
    mismatches = int((got != want).sum())
    assert mismatches == 0, f"{what}: {mismatches} of {got.numel()} differ"


def assert_same_quantized(got, want) -> None:
    for name, a, b in zip(("codes", "scale", "zero"), got, want):
        assert_same_bits(a, b, name)


def load_case(name):
    meta = INDEX["cases"][name]
    return meta, OscarConfig.from_dict(meta["config"]), load_file(str(VECTORS / meta["file"]))


# -- (a) quantize_pack equals the golden codec vectors --------------------------------------


@pytest.mark.parametrize("name", NEAREST)
def test_quantize_pack_matches_golden_codec_vectors(name):
    meta, cfg, t = load_case(name)
    levels = t["cache.k_levels"][0] if cfg.codebook == "lloyd-max" else None
    got = quantize_pack(t["codec.input"].to(DEVICE), cfg.k_bits, cfg.cluster_dim, cfg.k_clip, levels, cfg.scale_dtype)
    assert_same_quantized(got, (t["codec.codes"], t["codec.scale"], t["codec.zero"]))


# -- (b) randomized cases against codec.quantize --------------------------------------------


def random_vectors(gen, n, d, cluster_dim, bits, dtype, top=3.0):
    """Rows of magnitude 1e-4 to 10**top, then constant, tie and duplicate rows."""
    x = torch.randn(n, d, generator=gen) * torch.logspace(-4, top, n).unsqueeze(-1)
    x[0] = 0.0
    x[1] = -3.25  # constant vectors: scale 0, every code 0
    x[2, :cluster_dim] = 0.5  # one constant group beside random ones
    # Values on the uniform thresholds c + 0.5 (scale exactly 1): ties go to the lower code.
    levels = 2**bits - 1
    tie = torch.arange(d, dtype=torch.float32).remainder(2 * levels) * 0.5
    tie = tie.reshape(-1, cluster_dim)
    tie[:, 0], tie[:, 1] = 0.0, float(levels)
    x[3] = tie.reshape(d)
    x[4] = torch.randint(-3, 4, (d,), generator=gen).float()  # many duplicates of min/max
    return x.to(dtype)


RANDOM_CASES = [
    # bits, cluster_dim, head_dim, clip, lloyd, scale_dtype, input dtype
    (2, 32, 64, 1.0, False, "float16", torch.float16),
    (2, 64, 128, 0.96, False, "float16", torch.float16),
    (2, 128, 128, 0.92, True, "float16", torch.float32),
    (3, 32, 96, 1.0, False, "float16", torch.float16),  # 3 groups: padded to 4 in the kernel
    (3, 64, 64, 0.9, True, "bfloat16", torch.float16),
    (3, 128, 256, 0.77, False, "float32", torch.float32),
    (4, 32, 128, 0.5, True, "float16", torch.float16),
    (4, 64, 64, 1.0, False, "bfloat16", torch.float32),
    (4, 128, 128, 0.96, True, "float16", torch.float16),
    (2, 64, 128, 1.0, False, "float8_e4m3fn", torch.float16),
    (3, 32, 64, 0.9, True, "float8_e4m3fn", torch.float32),
]


@pytest.mark.parametrize("bits,cluster_dim,d,clip,lloyd,scale_dtype,dtype", RANDOM_CASES)
def test_quantize_pack_matches_codec_on_random_inputs(bits, cluster_dim, d, clip, lloyd, scale_dtype, dtype):
    gen = torch.Generator().manual_seed(bits * 1000 + cluster_dim + d)
    # 37 rows: a partial last block; fp8 scales stop at 448, so its rows stay below that
    x = random_vectors(gen, 37, d, cluster_dim, bits, dtype, 1.5 if scale_dtype == "float8_e4m3fn" else 3.0)
    levels = None
    if lloyd:
        levels = fit_lloyd_max_levels(torch.rand(4000, generator=gen) ** 2 * (2**bits - 1), bits, iterations=10)
    want = quantize(x.float(), bits, cluster_dim, clip, levels, scale_dtype)
    assert_same_quantized(quantize_pack(x.to(DEVICE), bits, cluster_dim, clip, levels, scale_dtype), want)
    # Leading dimensions are kept, and small blocks give the same bytes.
    got = quantize_pack(x[:36].reshape(3, 12, d).to(DEVICE), bits, cluster_dim, clip, levels, scale_dtype, block_n=4)
    assert_same_quantized([t.reshape(36, -1) for t in got], [t[:36] for t in want])


def test_quantize_pack_rejects_what_the_codec_rejects():
    x = torch.zeros(2, 64, device=DEVICE)
    x[1, 3] = float("nan")
    with pytest.raises(OscarInputError, match="NaN"):
        quantize_pack(x, 2, 32)
    with pytest.raises(OscarInputError, match="scale_dtype=float16"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy, inside the interpreter, sees the inf
        quantize_pack(torch.tensor([[-1e5] * 32 + [1e5] * 32], device=DEVICE), 2, 64)
    with pytest.raises(OscarInputError, match="cluster_dim"):
        quantize_pack(torch.zeros(2, 48, device=DEVICE), 2, 32)
    with pytest.raises(OscarInputError, match="bits"):
        quantize_pack(torch.zeros(2, 64, device=DEVICE), 5, 32)
    assert quantize_pack(torch.zeros(0, 64, device=DEVICE), 2, 32).codes.shape == (0, 16)


# -- (c, d) decode attention replays the golden caches: tests/ops/test_conformance.py (triton-*) --------


# -- splits, GQA groups, bf16 and fp8 scales and the fp16-body baseline on a longer body -------


def orthogonal(gen, d):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    return q.unsqueeze(0)


@pytest.mark.parametrize(
    "cfg,d,hq,hkv",
    [
        (OscarConfig(k_bits=3, v_bits=4, cluster_dim=32, codebook="lloyd-max", k_clip=0.96, sink=4, recent=8,
                     scale_dtype="bfloat16"), 96, 8, 2),
        (OscarConfig(k_bits=2, v_bits=2, cluster_dim=64, sink=0, recent=0), 64, 3, 3),
        (OscarConfig(k_bits=3, v_bits=2, cluster_dim=32, k_clip=0.92, sink=2, recent=4, scale_dtype="float8_e4m3fn"),
         64, 6, 2),
    ],
)
def test_split_k_decode_matches_reference_over_a_long_body(cfg, d, hq, hkv):
    gen = torch.Generator().manual_seed(7)
    n = 150
    levels = {"k": None, "v": None}
    if cfg.codebook == "lloyd-max":
        levels = {kind: fit_lloyd_max_levels(torch.rand(2000, generator=gen) * (2 ** cfg.bits(kind) - 1),
                                             cfg.bits(kind), iterations=5).unsqueeze(0).to(DEVICE) for kind in "kv"}
    cache = OscarKVCache(cfg, 1, hkv, d, n + 1, orthogonal(gen, d), orthogonal(gen, d), levels["k"], levels["v"],
                         device=DEVICE)
    twin = OscarKVCache(cfg, 1, hkv, d, n + 1, cache.rotation["k"], cache.rotation["v"], levels["k"], levels["v"],
                        device=DEVICE)
    k, v = torch.randn(hkv, n + 1, d, generator=gen) * 3, torch.randn(hkv, n + 1, d, generator=gen)
    k, v = k.to(DEVICE), v.to(DEVICE)
    cache.attend(0, torch.randn(hq, n, d, generator=gen).to(DEVICE), k[:, :n], v[:, :n])
    triton_append(twin, 0, k[:, :n], v[:, :n])  # one long chunk through the quantize kernel
    for kind in "kv":
        for region in REGIONS:
            # layer 0, the only one (codes are a list per layer)
            assert_same_bits(getattr(twin, region)[kind][0], getattr(cache, region)[kind][0], f"{kind}.{region}")

    q = (torch.randn(hq, d, generator=gen) * 2).to(DEVICE)
    k_new, v_new = (torch.randn(hkv, d, generator=gen).half().to(DEVICE) for _ in range(2))
    args = cache_decode_inputs(cache, 0)
    assert args["n_body"] == n - cfg.sink - cfg.recent
    want = reference_decode_attention(q, k_new=k_new, v_new=v_new, scaling=0.3, **args)
    for splits in (1, 3):
        got = decode_attention(q, k_new=k_new, v_new=v_new, scaling=0.3, num_splits=splits, block_n=16, **args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # The benchmark's fp16 baseline: the same kernel reading an fp16 body.
    k_body, v_body = (torch.randn(hkv, args["n_body"] + 5, d, generator=gen).half().to(DEVICE) for _ in range(2))
    fp16_args = dict(args, k_body=k_body, v_body=v_body)
    got = decode_attention(q, k_new=k_new, v_new=v_new, num_splits=2, **fp16_args)
    want = reference_decode_attention(q, k_new=k_new, v_new=v_new, **fp16_args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # And the whole attend path, against the reference cache.
    out = triton_decode_attend(cache, 0, q[:, None], k[:, n:], v[:, n:], num_splits=2)
    ref = twin.attend(0, q[:, None], k[:, n:], v[:, n:])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for kind in "kv":
        for region in REGIONS:
            assert_same_bits(getattr(cache, region)[kind][0], getattr(twin, region)[kind][0], f"{kind}.{region}")


def test_decode_attend_rejects_a_chunk():
    cache = OscarKVCache(OscarConfig(sink=2, recent=2), 1, 2, 64, 8, device=DEVICE)

    def zeros(*shape):
        return torch.zeros(*shape, device=DEVICE)

    with pytest.raises(OscarInputError, match="one token"):
        triton_decode_attend(cache, 0, zeros(4, 2, 64), zeros(2, 2, 64), zeros(2, 2, 64))
    with pytest.raises(OscarInputError, match="q_heads"):
        triton_decode_attend(cache, 0, zeros(3, 1, 64), zeros(2, 1, 64), zeros(2, 1, 64))
    assert cache.length[0] == 0


def test_feedback_rounding_decodes_with_the_kernel_and_appends_through_the_reference():
    """The decode kernel reads any packed body; a cache whose K codes are chosen with error feedback appends through
    the reference storage path, and the Triton quantize kernel, which rounds to the nearest level, refuses it."""
    gen = torch.Generator().manual_seed(9)
    weights = torch.triu(torch.randn(1, 2, 64, 64, generator=gen) * 0.3, 1)
    config = OscarConfig(k_rounding="feedback", sink=2, recent=3)
    cache = OscarKVCache(config, 1, 2, 64, 24, device=DEVICE, k_feedback=weights)
    twin = OscarKVCache(config, 1, 2, 64, 24, k_feedback=weights)
    q, k, v = (torch.randn(h, 20, 64, generator=gen) for h in (4, 2, 2))
    for c in (cache, twin):
        c.attend(0, *(x[:, :16].to(c.device) for x in (q, k, v)))
    out = triton_decode_attend(cache, 0, q[:, 16:17].to(DEVICE), k[:, 16:17].to(DEVICE), v[:, 16:17].to(DEVICE))
    torch.testing.assert_close(out.cpu(), twin.attend(0, q[:, 16:17], k[:, 16:17], v[:, 16:17]), rtol=1e-5,
                               atol=1e-5)
    for region in REGIONS:
        assert_same_bits(getattr(cache, region)["k"][0], getattr(twin, region)["k"][0], f"k.{region}")
    with pytest.raises(OscarInputError, match="k_rounding='feedback': the Triton quantize kernel rounds K to the "
                                              "nearest level only"):
        triton_append(cache, 0, k[:, 17:18].to(DEVICE), v[:, 17:18].to(DEVICE))
    with pytest.raises(OscarInputError, match="nearest level only"):
        triton_decode_attend(cache, 0, q[:, 17:18].to(DEVICE), k[:, 17:18].to(DEVICE), v[:, 17:18].to(DEVICE),
                             append="triton")


def test_fp8_scales_round_as_the_codec_at_every_value_and_tie():
    """Constant groups store their value as the zero: every finite E4M3 value up to 448, both signs, the midpoints
    between neighbours (ties, rounded to even) and one fp32 step either side of each, subnormals included."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes) & (codes.abs() <= 448)].unique()
    mid = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mid, torch.nextafter(mid, torch.tensor(-1e9)), torch.nextafter(mid, torch.tensor(1e9))])
    x = values[:, None].expand(-1, 32).contiguous()
    want = quantize(x, 2, 32, 1.0, None, "float8_e4m3fn")
    assert_same_quantized(quantize_pack(x.to(DEVICE), 2, 32, 1.0, None, "float8_e4m3fn"), want)


def test_fp8_scales_past_their_range_are_refused_as_the_codec_refuses_them():
    x = torch.tensor([[0.0] * 63 + [3 * 449.0]])  # scale 449
    with pytest.raises(OscarInputError) as codec_error:
        quantize(x, 2, 64, 1.0, None, "float8_e4m3fn")
    with pytest.raises(OscarInputError) as kernel_error:
        quantize_pack(x.to(DEVICE), 2, 64, scale_dtype="float8_e4m3fn")
    assert str(kernel_error.value) == str(codec_error.value)
    assert "scale_dtype=float8_e4m3fn (max 448)" in str(kernel_error.value)
    with pytest.raises(OscarInputError, match="max 448"):
        quantize_pack(torch.full((1, 64), -449.0, device=DEVICE), 2, 64, scale_dtype="float8_e4m3fn")  # the zero
