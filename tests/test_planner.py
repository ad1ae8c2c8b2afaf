import dataclasses
import json

import pytest

from oscar_export import OscarConfig, OscarInputError, OscarKVCache
from oscar_export.models import PRESETS, ModelShape, model_shape
from oscar_export.planner import cache_budget_bits, kv_bytes_per_token, parse_bytes, plan, weight_bytes

GiB = 2**30


def test_llama_2_7b_by_hand():
    shape = model_shape("llama-2-7b")
    p = plan(shape, OscarConfig(), 8 * GiB, 32768, weight_bits=4)
    # 32 layers x 32 KV heads x 128 dims x (K, V) x 2 bytes.
    assert p["kv_bytes_per_token_fp16"] == 32 * 32 * 128 * 2 * 2 == 524288
    # 2-bit body: 32 bytes of codes + 2 groups x (fp16 scale + fp16 zero) = 40 bytes per vector.
    assert p["kv_bytes_per_token"] == 32 * 32 * 2 * 40
    linear_params = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert p["weights_breakdown"]["linear"] == linear_params // 2 + linear_params // 32 * 4
    assert p["weights_breakdown"]["embeddings"] == 32000 * 4096 * 2
    assert p["reserve_bytes"] == int(0.2 * 8 * GiB)
    assert not p["fits"] and p["warnings"]  # 32K is past Llama 2's 4096 positions


def test_bits_per_element_at_128k_with_cluster_128():
    p = plan(model_shape("llama-3-8b"), OscarConfig(cluster_dim=128), 16 * GiB, 131072)
    assert p["bits_per_element"] <= 2.30


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_max_context_is_the_boundary(preset):
    shape = model_shape(preset)
    p = plan(shape, OscarConfig(), 8 * GiB, 1024)
    at = plan(shape, OscarConfig(), 8 * GiB, p["max_context"])
    past = plan(shape, OscarConfig(), 8 * GiB, p["max_context"] + 1)
    assert at["fits"] and not past["fits"]
    assert p["max_context"] > 5 * p["max_context_fp16"]


def test_bundled_kv_bytes_equal_what_the_reference_cache_allocates():
    shape = model_shape("bundled")
    for cfg in (OscarConfig(), OscarConfig(k_bits=3, v_bits=4, cluster_dim=32, sink=8, recent=16)):
        context = 1500
        p = plan(shape, cfg, 8 * GiB, context)
        cache = OscarKVCache(cfg, shape.layers, shape.kv_heads, shape.head_dim, context)
        bigger = OscarKVCache(cfg, shape.layers, shape.kv_heads, shape.head_dim, context + 1)
        assert p["kv_bytes"] == cache.nbytes
        assert p["kv_bytes_per_token"] == bigger.nbytes - cache.nbytes == kv_bytes_per_token(cfg, shape)


def test_local_checkpoint_and_tied_embeddings(tmp_path):
    cfg = dict(PRESETS["mistral-7b"], tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(str(tmp_path))
    assert shape.kv_heads == 8 and shape.head_dim == 128
    assert weight_bytes(shape, 16)["lm_head"] == 0  # one fp16 table serves the lookup and the matmul
    assert weight_bytes(shape, 4)["lm_head"] == weight_bytes(dataclasses.replace(shape, tied_embeddings=False), 4)["lm_head"] > 0


@pytest.mark.parametrize(
    "text, expected",
    [("8GB", 8 * GiB), ("8 GiB", 8 * GiB), ("6.5GB", int(6.5 * GiB)), ("512MB", 512 * 2**20), ("1024", 1024)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["8XB", "", "GB", "-1GB", "0GB", "8 G B"])
def test_parse_bytes_rejects(text):
    with pytest.raises(OscarInputError, match="expected a"):
        parse_bytes(text, "--device-memory")


def test_bad_models_and_plans(tmp_path):
    with pytest.raises(OscarInputError, match="model 'nope': no config.json"):
        model_shape("nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(OscarInputError, match="lacks attention/shape fields"):
        model_shape(str(tmp_path))
    shape = model_shape("llama-3-8b")
    with pytest.raises(OscarInputError, match="context=0"):
        plan(shape, OscarConfig(), 8 * GiB, 0)
    with pytest.raises(OscarInputError, match="weight_bits=3"):
        plan(shape, OscarConfig(), 8 * GiB, 10, weight_bits=3)
    with pytest.raises(OscarInputError, match="reserve"):
        plan(shape, OscarConfig(), 8 * GiB, 10, reserve=9 * GiB)
    small = ModelShape.from_hf_config("x", dict(PRESETS["llama-3-8b"], head_dim=64))
    with pytest.raises(OscarInputError, match="cluster_dim=128 does not divide head_dim=64"):
        plan(small, OscarConfig(cluster_dim=128), 8 * GiB, 10)


def test_feedback_rounding_counts_the_graph_buffers():
    """Feedback rounding stores K's [D, D] weights per layer and KV head beside the K rotation; the planner
    counts the same bytes the exportable graph registers as buffers."""
    import torch

    from oscar_export.export.graph import OscarDecoderLayer
    from oscar_export.models import load_model

    (model, _), shape = load_model("bundled"), model_shape("bundled")
    cfg = OscarConfig(k_rounding="feedback")
    eye = torch.eye(shape.head_dim).expand(shape.kv_heads, -1, -1)
    layers = [OscarDecoderLayer(block, cfg, eye, eye, torch.zeros(0), torch.zeros(0), torch.tril(eye * 0.01, -1))
              for block in model.model.layers]
    graph_bytes = sum(layer.k_feedback.nbytes + layer.k_rot.nbytes for layer in layers)
    nearest = plan(shape, OscarConfig(), 8 * GiB, 1024)["weights_breakdown"]["rotations"]
    assert plan(shape, cfg, 8 * GiB, 1024)["weights_breakdown"]["rotations"] == graph_bytes == 2 * nearest


@pytest.mark.parametrize("preset, memory, context", [("llama-3-8b", 8 * GiB, 32768), ("bundled", GiB // 64, 2048),
                                                     ("qwen2.5-7b", 8 * GiB, 131072)])
def test_the_cache_budget_is_the_bits_per_element_at_which_the_plan_stops_fitting(preset, memory, context):
    """A format at the budget fits, one a byte per layer and head past it does not: counted with the planner's
    own weights and reserve, and with the cache bytes cache_bytes() counts (bits per element times elements)."""
    shape = model_shape(preset)
    budget = cache_budget_bits(shape, memory, context, weight_group=64, weight_zero_points=False)
    p = plan(shape, OscarConfig(), memory, context, weight_group=64, weight_zero_points=False)
    assert p["cache_budget_bits"] == pytest.approx(budget)
    elements = context * shape.layers * shape.kv_heads * shape.head_dim * 2
    assert budget * elements / 8 == pytest.approx(memory - p["reserve_bytes"] - p["weights_bytes"])
    assert p["fits"] == (p["bits_per_element"] <= budget)
    # Windows of fp16 tokens move the cache across the budget token by token: the last that fits is within it.
    windows = [OscarConfig(sink=0, recent=r) for r in range(0, context + 1, max(context // 64, 1))]
    for config in windows:
        at = plan(shape, config, memory, context, weight_group=64, weight_zero_points=False)
        assert at["fits"] == (at["bits_per_element"] <= budget + 1e-12), config


def test_a_device_the_weights_fill_leaves_a_negative_budget():
    assert cache_budget_bits(model_shape("llama-3-8b"), 4 * GiB, 4096) < 0
