import pytest
import torch

from oscar_export import OscarConfig, OscarKVCache
from oscar_export.config import OscarInputError
from oscar_export.hf_cache import OscarCache, patch_model_for_kv_quant, route_attention
from oscar_export.models import ModelShape
from oscar_export.planner import plan
from oscar_export.calibration.rotations import hadamard_rotations
from tiny_models import FAMILIES, tiny_model


def reference_greedy(model, ids, steps, cache):
    """Greedy decoding with the Foundation reference cache, driven by hand (no generate())."""
    tokens = ids[0].tolist()
    with route_attention(model, cache), torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
        for _ in range(steps):
            tokens.append(int(logits[0, -1].argmax()))
            pos = torch.tensor([[len(tokens) - 1]])
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=pos, use_cache=False).logits
    return tokens[ids.shape[1]:]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bits", [2, 3])
def test_generate_equals_the_reference_path(family, bits):
    model = tiny_model(family, seed=bits)
    ids = torch.randint(0, 120, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = dict(sink=4, recent=8)
    patch_model_for_kv_quant(model, OscarConfig(k_bits=bits, v_bits=bits, cluster_dim=32, **cfg), rotations="hadamard")
    out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, 40:].tolist()
    ref_cache = OscarKVCache(OscarConfig(k_bits=bits, v_bits=bits, cluster_dim=32, **cfg), 2, 2, 64, 52,
                             hadamard_rotations(2, 64), hadamard_rotations(2, 64))
    assert out == reference_greedy(model, ids, 12, ref_cache)


def test_cache_is_really_packed_and_its_bytes_match_the_planner():
    model = tiny_model("llama")
    patch_model_for_kv_quant(model, OscarConfig(sink=4, recent=8), rotations="online")
    cache = OscarCache(model, max_context=200)
    ids = torch.randint(0, 120, (1, 50))
    model.generate(ids, max_new_tokens=5, do_sample=False, cache=cache)
    assert cache.get_seq_length() == 54  # the last generated token is never fed back
    for codes in cache.kv.codes["k"]:  # one tensor per layer
        assert codes.dtype == torch.uint8 and codes.shape[-1] == 16  # 64 dims x 2 bits
        assert torch.count_nonzero(codes[:, : 54 - 12]) > 0
    shape = ModelShape.from_hf_config("tiny", model.config.to_dict())
    assert cache.nbytes == plan(shape, model.oscar.config, 8 * 2**30, 200)["kv_bytes"]


def test_online_rotations_are_estimated_then_frozen():
    model = tiny_model("llama")
    patch_model_for_kv_quant(model, OscarConfig(sink=2, recent=4), rotations="online")
    cache = OscarCache(model, max_context=64)
    model.generate(torch.randint(0, 120, (1, 20)), max_new_tokens=3, do_sample=False, cache=cache)
    rot = cache.kv.rotation["k"]
    assert rot is not None and not torch.allclose(rot[0, 0], torch.eye(64))
    eye = torch.eye(64)
    assert torch.allclose(rot[1, 0].T @ rot[1, 0], eye, atol=1e-5)
    with pytest.raises(OscarInputError, match="rotations are frozen"):
        cache.kv.set_rotation(0, eye, eye)


def test_plain_forward_of_a_patched_model_is_unchanged():
    model = tiny_model("llama")
    ids = torch.randint(0, 120, (1, 30))
    before = model(input_ids=ids, use_cache=False).logits
    patch_model_for_kv_quant(model)
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, before)


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(OscarInputError, match="cluster_dim=128 does not divide head_dim=64"):
        patch_model_for_kv_quant(model, OscarConfig(cluster_dim=128))
    with pytest.raises(TypeError, match="config is dict: expected an OscarConfig or None"):
        patch_model_for_kv_quant(model, {"k_bits": 2})
    with pytest.raises(OscarInputError, match="backend='cuda'"):
        patch_model_for_kv_quant(model, backend="cuda")
    with pytest.raises(OscarInputError, match="not patched"):
        OscarCache(tiny_model("llama"))
    patch_model_for_kv_quant(model)
    with pytest.raises(OscarInputError, match="batch size 2"):
        model.generate(torch.randint(0, 120, (2, 10)), max_new_tokens=2, do_sample=False)


def test_triton_backend_generates_the_same_tokens():
    model = tiny_model("llama", seed=5)
    ids = torch.randint(0, 120, (1, 30), generator=torch.Generator().manual_seed(1))
    for scale_dtype in ("float16", "float8_e4m3fn"):
        config = OscarConfig(cluster_dim=32, sink=4, recent=8, scale_dtype=scale_dtype)
        patch_model_for_kv_quant(model, config, rotations="hadamard", backend="reference")
        reference = model.generate(ids, max_new_tokens=6, do_sample=False)
        patch_model_for_kv_quant(model, config, rotations="hadamard", backend="triton")
        assert model.oscar.backend == "triton"
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), reference), scale_dtype
