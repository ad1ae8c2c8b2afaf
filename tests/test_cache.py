import json

import pytest
import torch
import torch.nn.functional as F

from oscar_export import OscarConfig, OscarInputError, OscarKVCache, bits_per_element, cache_bytes
from oscar_export.codec import dequantize, quantize

D, HKV, HQ = 64, 2, 4


def orthogonal(seed, *lead):
    q, _ = torch.linalg.qr(torch.randn(*lead, D, D, generator=torch.Generator().manual_seed(seed)))
    return q


def signed_permutation(seed):
    """An orthogonal matrix whose products are exact in any summation order, so the rotated fp16 vectors
    (and with them every code) are the same on every CPU and BLAS: the test then checks the format alone."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (D,), generator=g).float() * 2 - 1
    return torch.eye(D)[torch.randperm(D, generator=g)] * signs


def expected_kv(x, rot, cfg, kind, n_cached):
    """Position-by-position representation after n_cached tokens, written from the format rules alone."""
    out = [x[:, :0]]
    for p in range(n_cached):
        vec = (x[:, p] @ rot).to(torch.float16).float()
        in_body = cfg.sink <= p < n_cached - cfg.recent
        if in_body:
            bits, clip = cfg.bits(kind), cfg.clip(kind)
            vec = dequantize(*quantize(vec, bits, cfg.cluster_dim, clip, None, cfg.scale_dtype), bits, cfg.cluster_dim)
        out.append(vec[:, None])
    return torch.cat(out, 1)


@pytest.mark.parametrize(
    "cfg",
    [
        OscarConfig(sink=3, recent=5),
        OscarConfig(k_bits=3, v_bits=4, cluster_dim=32, sink=0, recent=7, k_clip=0.9),
        OscarConfig(sink=4, recent=0),
        OscarConfig(sink=0, recent=0),
        OscarConfig(k_bits=3, sink=2, recent=4, k_clip=0.85, scale_dtype="float8_e4m3fn"),
    ],
)
def test_decode_attention_matches_independent_attention(cfg):
    gen = torch.Generator().manual_seed(0)
    n = 23
    q, k, v = torch.randn(HQ, n, D, generator=gen), torch.randn(HKV, n, D, generator=gen), torch.randn(HKV, n, D, generator=gen)
    rk, rv = signed_permutation(1), signed_permutation(2)
    cache = OscarKVCache(cfg, 1, HKV, D, n, rk.unsqueeze(0), rv.unsqueeze(0))
    for t in range(n):
        out = cache.attend(0, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
        # Independent: the cached tokens as the format says, plus the new token at fp16.
        keys = torch.cat([expected_kv(k, rk, cfg, "k", t), (k[:, t : t + 1] @ rk).half().float()], 1)
        vals = torch.cat([expected_kv(v, rv, cfg, "v", t), (v[:, t : t + 1] @ rv).half().float()], 1)
        ref = F.scaled_dot_product_attention((q[:, t : t + 1] @ rk)[None], keys[None], vals[None], enable_gqa=True)[0]
        torch.testing.assert_close(out, ref @ rv.T, rtol=1e-4, atol=1e-4)


def test_prefill_matches_sdpa_up_to_fp16_and_rotation_is_invisible():
    # Everything in fp16 windows: only fp16 rounding separates the result from plain attention.
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(HQ, 40, D, generator=gen), torch.randn(HKV, 40, D, generator=gen), torch.randn(HKV, 40, D, generator=gen)
    cache = OscarKVCache(OscarConfig(sink=8, recent=64), 1, HKV, D, 40, orthogonal(3, 1, HKV), orthogonal(4, 1, HKV))
    out = cache.attend(0, q, k, v)
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-3)


@pytest.mark.parametrize("chunks", [[23], [1] * 23, [5, 1, 9, 8], [12, 11], [3, 17, 3]])
def test_chunking_does_not_change_the_stored_cache(chunks):
    cfg = OscarConfig(k_bits=3, v_bits=2, cluster_dim=32, sink=3, recent=6)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(HKV, 23, D, generator=gen), torch.randn(HKV, 23, D, generator=gen)
    one = OscarKVCache(cfg, 2, HKV, D, 30)
    one.append(1, k, v)
    many = OscarKVCache(cfg, 2, HKV, D, 30)
    start = 0
    for size in chunks:
        many.append(1, k[:, start : start + size], v[:, start : start + size])
        start += size
    for region in ("sink", "recent", "codes", "scale", "zero"):
        for kind in ("k", "v"):
            by_layer = zip(getattr(one, region)[kind], getattr(many, region)[kind])  # codes are a list per layer
            assert all(torch.equal(a, b) for a, b in by_layer), (region, kind)
    torch.testing.assert_close(many.stored("k", 1), expected_kv(k, torch.eye(D), cfg, "k", 23), rtol=0, atol=0)


def test_ring_slots_follow_the_documented_rule():
    cfg = OscarConfig(sink=2, recent=4)
    cache = OscarKVCache(cfg, 1, 1, D, 20)
    x = torch.arange(11, dtype=torch.float32)[None, :, None].expand(1, 11, D).contiguous()
    cache.append(0, x, x)
    # Positions 7..10 live in the ring at slot (p - 2) % 4: 7->1, 8->2, 9->3, 10->0.
    assert cache.recent["k"][0, 0, :, 0].tolist() == [10.0, 7.0, 8.0, 9.0]
    assert cache.sink["k"][0, 0, :, 0].tolist() == [0.0, 1.0]
    # Body rows 0..4 hold positions 2..6 (constant vectors: exact, scale 0).
    assert cache.zero["k"][0, 0, :5, 0].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_nbytes_matches_formula_and_capacity_is_enforced():
    for cfg in (OscarConfig(), OscarConfig(k_bits=3, v_bits=4, cluster_dim=32, sink=5, recent=3, scale_dtype="float32"),
                OscarConfig(scale_dtype="float8_e4m3fn")):
        for max_context in (1, 10, 64, 320, 321, 1000):
            cache = OscarKVCache(cfg, 3, HKV, D, max_context)
            assert cache.nbytes == cache_bytes(cfg, 3, HKV, D, max_context)
    cache = OscarKVCache(OscarConfig(sink=2, recent=2), 1, HKV, D, 5)
    cache.append(0, torch.zeros(HKV, 5, D), torch.zeros(HKV, 5, D))
    with pytest.raises(OscarInputError, match="cache capacity exceeded: 5 \\+ 1 tokens > max_context=5"):
        cache.append(0, torch.zeros(HKV, 1, D), torch.zeros(HKV, 1, D))


def test_bits_per_element():
    cfg = OscarConfig(cluster_dim=128)
    assert bits_per_element(cfg, 128, 320) == 16.0
    assert bits_per_element(cfg, 128, 131072) <= 2.30
    assert abs(bits_per_element(cfg, 128, 10**9) - 2.25) < 1e-4
    assert abs(bits_per_element(OscarConfig(k_bits=4, v_bits=4, cluster_dim=32, sink=0, recent=0), 64, 7) - 5.0) < 1e-12
    # fp8 scale and zero: one byte each, so group 64 at head_dim 64 costs what group 128 does with fp16
    fp8 = OscarConfig(sink=0, recent=0, scale_dtype="float8_e4m3fn")
    assert bits_per_element(fp8, 64, 100) == 2.25 == bits_per_element(OscarConfig(cluster_dim=128, sink=0, recent=0), 128, 100)


def test_bad_input_is_named():
    cache = OscarKVCache(OscarConfig(), 2, HKV, D, 16)
    with pytest.raises(OscarInputError, match=r"k has shape \(3, 4, 64\): expected \(2, tokens, 64\)"):
        cache.append(0, torch.zeros(3, 4, D), torch.zeros(HKV, 4, D))
    with pytest.raises(OscarInputError, match="layer=2"):
        cache.append(2, torch.zeros(HKV, 1, D), torch.zeros(HKV, 1, D))
    bad = torch.zeros(HKV, 1, D)
    bad[0, 0, 0] = float("nan")
    with pytest.raises(OscarInputError, match="v contains NaN"):
        cache.append(0, torch.zeros(HKV, 1, D), bad)
    with pytest.raises(OscarInputError, match="fp16 window range"):
        cache.append(0, torch.full((HKV, 1, D), 1e6), torch.zeros(HKV, 1, D))
    with pytest.raises(OscarInputError, match="q has shape"):
        cache.attend(0, torch.zeros(3, 1, D), torch.zeros(HKV, 1, D), torch.zeros(HKV, 1, D))
    with pytest.raises(OscarInputError, match="k_rotation has shape"):
        OscarKVCache(OscarConfig(), 2, HKV, D, 16, k_rotation=torch.eye(D))
    with pytest.raises(OscarInputError, match="cluster_dim=64 does not divide head_dim=48"):
        OscarKVCache(OscarConfig(), 2, HKV, 48, 16)
    with pytest.raises(OscarInputError, match="k_levels: expected 2 Lloyd-Max codebooks"):
        OscarKVCache(OscarConfig(codebook="lloyd-max"), 2, HKV, D, 16)
    assert cache.length == [0, 0]  # nothing half-written


MIXED = OscarConfig(k_bits=2, k_clip=0.7, k_bits_by_layer=(2, 3, 2, 4), k_clip_by_layer=(0.7, 0.85, 1.0, 0.9),
                    sink=3, recent=5)


def test_per_layer_key_bits_store_each_layer_as_a_cache_of_that_width():
    """Layer i of a mixed cache holds exactly what a one-width cache of layer i's K bits and clip holds."""
    gen = torch.Generator().manual_seed(4)
    rot = torch.stack([signed_permutation(i) for i in range(4)])
    mixed = OscarKVCache(MIXED, 4, HKV, D, 40, k_rotation=rot, v_rotation=rot)
    for layer in range(4):
        bits, clip = MIXED.k_bits_by_layer[layer], MIXED.k_clip_by_layer[layer]
        alone = OscarKVCache(OscarConfig(k_bits=bits, k_clip=clip, sink=3, recent=5), 1, HKV, D, 40,
                             k_rotation=rot[layer:layer + 1], v_rotation=rot[layer:layer + 1])
        q = torch.randn(HQ, 30, D, generator=gen)
        k, v = torch.randn(HKV, 30, D, generator=gen), torch.randn(HKV, 30, D, generator=gen)
        assert torch.equal(mixed.attend(layer, q, k, v), alone.attend(0, q, k, v))
        assert mixed.codes["k"][layer].shape[-1] == D * bits // 8
        assert torch.equal(mixed.codes["k"][layer], alone.codes["k"][0])
        assert torch.equal(mixed.stored("k", layer), expected_kv(k, rot[layer], MIXED.layer(layer), "k", 30))
    assert mixed.nbytes == cache_bytes(MIXED, 4, HKV, D, 40)


def test_per_layer_key_bits_in_the_byte_and_bit_counts():
    one_width = [OscarConfig(k_bits=b, sink=3, recent=5) for b in MIXED.k_bits_by_layer]
    assert cache_bytes(MIXED, 4, HKV, D, 500) == sum(cache_bytes(c, 1, HKV, D, 500) for c in one_width)
    # Windows are fp16 at any width; the body averages the layers' widths: (2+3+2+4)/4 K bits plus 2 V bits.
    assert bits_per_element(MIXED, D, 10**9) == pytest.approx((11 / 4 + 2) / 2 + 0.5, abs=1e-6)
    assert bits_per_element(MIXED, D, 500) == pytest.approx(
        sum(bits_per_element(c, D, 500) for c in one_width) / 4, rel=1e-12)


def test_per_layer_key_bits_round_trip_and_refuse_what_they_cannot_be():
    assert OscarConfig.from_dict(json.loads(MIXED.to_json())) == MIXED  # JSON lists back to tuples
    assert MIXED.layer(3) == OscarConfig(k_bits=4, k_clip=0.9, sink=3, recent=5)
    assert MIXED.describe() == "K2 (4 in 2 of 4 layers)/V2"
    with pytest.raises(OscarInputError, match=r"K's width is per layer .* config.layer\(i\)"):
        MIXED.bits("k")
    assert MIXED.bits("v") == 2
    bad = [
        (dict(k_bits_by_layer=(2, 3)), "k_bits_by_layer has 2 entries and k_clip_by_layer 0"),
        (dict(k_bits=3, k_bits_by_layer=(2, 3), k_clip_by_layer=(1.0, 1.0)), "expected k_bits=2, the narrowest"),
        (dict(k_bits_by_layer=(2, 5), k_clip_by_layer=(1.0, 1.0)), r"layer 1 of k_bits_by_layer .* k_bits=5"),
        (dict(k_bits_by_layer=(2, 3), k_clip_by_layer=(1.0, 0.2)), r"layer 1 of .* k_clip=0.2"),
        (dict(k_bits_by_layer=(2, 3), k_clip_by_layer=(1, 1), codebook="lloyd-max"), "expected 'uniform'"),
        (dict(k_bits_by_layer="23"), "expected a list, one entry per layer"),
    ]
    for fields, message in bad:
        with pytest.raises(OscarInputError, match=message):
            OscarConfig(**fields)
    with pytest.raises(OscarInputError, match="k_bits_by_layer has 4 entries: expected one per layer, 3"):
        OscarKVCache(MIXED, 3, HKV, D, 16)


def test_feedback_rounding_chooses_k_codes_with_the_layer_and_head_weights():
    """With k_rounding='feedback' a body row's K codes are codec.quantize of its fp16 value with its layer's and KV
    head's weights, whether it arrived in a prefill or left the ring later; V, scales and zeros are as without."""
    gen = torch.Generator().manual_seed(6)
    weights = torch.triu(torch.randn(2, HKV, D, D, generator=gen) * 0.3, 1)
    config = OscarConfig(k_rounding="feedback", k_clip=0.85, sink=3, recent=5)
    rot = torch.stack([signed_permutation(i) for i in range(2)])
    cache = OscarKVCache(config, 2, HKV, D, 40, rot, rot, k_feedback=weights)
    plain = OscarKVCache(OscarConfig(k_clip=0.85, sink=3, recent=5), 2, HKV, D, 40, rot, rot)
    q = torch.randn(HQ, 30, D, generator=gen)
    k, v = torch.randn(HKV, 30, D, generator=gen), torch.randn(HKV, 30, D, generator=gen)
    for c in (cache, plain):
        c.attend(1, q[:, :20], k[:, :20], v[:, :20])
        for t in range(20, 30):  # decode steps: rows leave the ring one by one
            c.attend(1, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
    body = (k[:, 3:25] @ rot[1]).to(torch.float16).float()
    want = quantize(body, 2, D, 0.85, feedback=weights[1][:, None])
    assert torch.equal(cache.codes["k"][1][:, :22], want.codes)
    assert not torch.equal(cache.codes["k"][1], plain.codes["k"][1])
    for kind, region in (("k", "scale"), ("k", "zero"), ("v", "scale"), ("v", "zero")):
        assert torch.equal(getattr(cache, region)[kind], getattr(plain, region)[kind])
    assert torch.equal(cache.codes["v"][1], plain.codes["v"][1])


def test_feedback_weights_exactly_with_feedback_rounding():
    weights = torch.zeros(2, HKV, D, D)
    with pytest.raises(OscarInputError, match="k_feedback absent but k_rounding='feedback'"):
        OscarKVCache(OscarConfig(k_rounding="feedback"), 2, HKV, D, 16)
    with pytest.raises(OscarInputError, match="k_feedback given but k_rounding='nearest'"):
        OscarKVCache(OscarConfig(), 2, HKV, D, 16, k_feedback=weights)
    with pytest.raises(OscarInputError, match=r"k_feedback has shape \(2, 1, 64, 64\): expected \(2, 2, 64, 64\)"):
        OscarKVCache(OscarConfig(k_rounding="feedback"), 2, HKV, D, 16, k_feedback=weights[:, :1])
    with pytest.raises(OscarInputError, match="k_rounding='feedback' with codebook='lloyd-max': expected codebook"):
        OscarConfig(k_rounding="feedback", codebook="lloyd-max")
    with pytest.raises(OscarInputError, match="k_rounding='up': expected one of"):
        OscarConfig(k_rounding="up")
    assert OscarConfig(k_rounding="feedback").describe() == "K2/V2, K feedback"
