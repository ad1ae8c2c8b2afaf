"""The exportable graph (oscar_export/export/graph.py): the custom op and OscarCausalLM against the reference."""

import numpy as np
import pytest
import torch

from backends import BACKEND, replay
from model_checks import assert_within_bounds, body_mismatches
from native_cases import GOLDEN, assert_final_cache, golden_case, random_case
from oscar_export import OscarConfig
from oscar_export.config import OscarInputError
from oscar_export.export.graph import CACHE_NAMES, OscarCausalLM, greedy
from oscar_export.hf_cache import OscarCache, patch_model_for_kv_quant
from oscar_export.models import BUNDLED_MODEL_DIR, load_model
from oscar_export.ops.attention import op_attributes
from oscar_export.calibration.files import RotationSet
from tiny_models import FAMILIES, tiny_model

PROMPT, STEPS, CONTEXT = 100, 64, 200
WINDOWS = dict(sink=16, recent=32)  # a 100-token prompt puts 52 tokens in the packed body
pytestmark = pytest.mark.usefixtures("single_threaded")


# -- the op (its golden-vector replays: tests/ops/test_conformance.py) --------------------------------


def test_op_matches_random_reference_sequences():
    rng = np.random.default_rng(7)
    for i in range(40):
        case = random_case(rng, i)
        worst, cache = replay(BACKEND["torch-inplace"], case)
        assert worst <= 1e-5, f"{case.name} ({case.config})"
        assert_final_cache(case, cache)


def test_op_names_a_wrong_buffer():
    case = golden_case(GOLDEN[0])
    cache = {name: torch.from_numpy(a) for name, a in case.empty_cache().items()}
    cache["k_scale"] = cache["k_scale"][:, 1:]
    q, k, v = (torch.from_numpy(x) for x in case.chunks[0])
    with pytest.raises(OscarInputError, match="k_scale"):
        torch.ops.oscar.attention(q, k, v, *(cache[n] for n in CACHE_NAMES), cache["k_levels"], cache["v_levels"],
                                  cache["k_feedback"], torch.tensor([0]),
                                  *op_attributes(case.config, case.scaling).values())


# -- the model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = load_model("bundled")
    ids = tokenizer((BUNDLED_MODEL_DIR / "heldout.txt").read_text(), verbose=False)["input_ids"][:PROMPT]
    return model, torch.tensor([ids])


def test_greedy_tokens_equal_the_reference_generate(bundled):
    model, ids = bundled
    module = OscarCausalLM(model, OscarConfig(**WINDOWS), "hadamard").eval()
    tokens = greedy(module, ids, STEPS, CONTEXT)
    patch_model_for_kv_quant(model, OscarConfig(cluster_dim=64, **WINDOWS), rotations="hadamard")
    want = model.generate(ids, max_new_tokens=STEPS, do_sample=False)[0, PROMPT:].tolist()
    assert len(want) == STEPS and tokens == want


def test_folded_v_rotation_matches_the_unfolded_reference(bundled):
    """The module folds R_v into v_proj and R_v^T into o_proj; the reference rotates explicitly."""
    model, ids = bundled
    module = OscarCausalLM(model, OscarConfig(**WINDOWS), "hadamard").eval()
    cache = module.new_cache(CONTEXT)
    with torch.no_grad():
        logits = module(ids, torch.tensor([0]), *cache)[0, -1]
        x = torch.randn(1, 5, model.config.hidden_size)
        layer, attn = module.layers[1], model.model.layers[1].self_attn
        folded = layer.v_proj(x).view(1, 5, 2, 64).transpose(1, 2)[0]
        explicit = attn.v_proj(x).view(1, 5, 2, 64).transpose(1, 2)[0] @ layer.k_rot  # Hadamard: R_v = R_k
    assert torch.allclose(folded, explicit, atol=1e-5)

    patch_model_for_kv_quant(model, OscarConfig(cluster_dim=64, **WINDOWS), rotations="hadamard")
    ref = OscarCache(model, max_context=CONTEXT)
    with torch.no_grad():
        want = model(ids, cache=ref, use_cache=True).logits[0, -1]
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-4
    # K is rotated as the reference rotates it, but deeper layers see hidden states that went through the
    # folded V projection, which rounds differently: body mismatches counted (docs/format.md, section 7).
    body = ids.shape[1] - WINDOWS["sink"] - WINDOWS["recent"]
    pairs = [(kind, region, cache[i * len(CACHE_NAMES) + CACHE_NAMES.index(f"{kind}_{region}")][:, :body].numpy(),
              getattr(ref.kv, region)[kind][i][:, :body].numpy())
             for kind in "kv" for region in ("codes", "scale", "zero") for i in range(4)]
    assert_within_bounds(body_mismatches(pairs, {"k": 2, "v": 2}), "folded graph")


def test_torch_export_with_a_dynamic_prefill_length(bundled):
    model, ids = bundled
    module = OscarCausalLM(model, OscarConfig(**WINDOWS), "hadamard").eval()
    cache = module.new_cache(CONTEXT)
    chunk = torch.export.Dim("T", min=1, max=512)
    ep = torch.export.export(module, (ids[:, :8], torch.tensor([0]), *cache),
                             dynamic_shapes=({1: chunk}, None, (None,) * len(cache)))
    assert sum(n.target == torch.ops.oscar.attention.default for n in ep.graph.nodes) == 4
    exported, eager = module.new_cache(CONTEXT), module.new_cache(CONTEXT)
    run = ep.module()
    with torch.no_grad():
        for start, end in ((0, 60), (60, 61), (61, 62)):  # a prefill, then decode steps
            got = run(ids[:, start:end], torch.tensor([start]), *exported)
            want = module(ids[:, start:end], torch.tensor([start]), *eager)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(exported, eager))


def random_rotation_set(layers: int, kv_heads: int, d: int, seed: int) -> RotationSet:
    """Per-(layer, KV head) orthogonal rotations (format v2)."""
    g = torch.Generator().manual_seed(seed)
    q = [torch.linalg.qr(torch.randn(layers, kv_heads, d, d, generator=g, dtype=torch.float64))[0].float()
         for _ in "kv"]
    return RotationSet(k=q[0], v=q[1], metadata={})


def test_every_family_of_the_table_has_a_tiny_model():
    from oscar_export.models import FAMILIES as TABLE

    assert sorted(FAMILIES) == sorted(TABLE)  # a new family row needs its tiny model in tests/tiny_models.py


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_equals_the_reference(family):
    model = tiny_model(family, seed=3)
    ids = torch.randint(0, 120, (1, 40), generator=torch.Generator().manual_seed(1))
    cfg = dict(sink=4, recent=8, cluster_dim=32, k_clip=0.96, v_clip=0.92)
    rotations = random_rotation_set(2, 2, 64, seed=5) if family in ("qwen2", "qwen3") else "hadamard"
    module = OscarCausalLM(model, OscarConfig(**cfg), rotations).eval()
    tokens = greedy(module, ids, 12, 64)
    patch_model_for_kv_quant(model, OscarConfig(**cfg), rotations=rotations)
    assert tokens == model.generate(ids, max_new_tokens=12, do_sample=False)[0, 40:].tolist()


def test_fp8_scales_equal_the_reference():
    """scale_dtype float8_e4m3fn: the graph's uint8 scale buffers hold the E4M3 bits the reference cache stores,
    so its tokens are the reference's."""
    model = tiny_model("llama", seed=5)
    ids = torch.randint(0, 120, (1, 40), generator=torch.Generator().manual_seed(3))
    cfg = dict(sink=4, recent=8, cluster_dim=32, scale_dtype="float8_e4m3fn")
    module = OscarCausalLM(model, OscarConfig(**cfg), "hadamard").eval()
    scales = {name: dtype for name, _, dtype in module.cache_spec(64) if name.startswith("layer0.")}
    assert scales["layer0.k_scale"] == scales["layer0.v_zero"] == torch.uint8
    assert scales["layer0.k_sink"] == torch.float16
    tokens = greedy(module, ids, 12, 64)
    patch_model_for_kv_quant(model, OscarConfig(**cfg), rotations="hadamard")
    assert tokens == model.generate(ids, max_new_tokens=12, do_sample=False)[0, 40:].tolist()


def test_lloyd_max_levels_come_from_the_rotation_file():
    model = tiny_model("llama", seed=4)
    ids = torch.randint(0, 120, (1, 40), generator=torch.Generator().manual_seed(2))
    rotations = random_rotation_set(2, 2, 64, seed=6)
    rotations.k_levels = rotations.v_levels = torch.tensor([[0.0, 0.8, 2.1, 3.0], [0.0, 1.2, 1.9, 3.0]])
    cfg = dict(sink=4, recent=8, codebook="lloyd-max")
    module = OscarCausalLM(model, OscarConfig(**cfg), rotations).eval()
    assert torch.equal(module.layers[1].v_levels, rotations.v_levels[1])
    tokens = greedy(module, ids, 12, 64)
    patch_model_for_kv_quant(model, OscarConfig(**cfg), rotations=rotations)
    assert tokens == model.generate(ids, max_new_tokens=12, do_sample=False)[0, 40:].tolist()


def test_refusals():
    model = tiny_model("llama")
    with pytest.raises(OscarInputError, match="online"):
        OscarCausalLM(model, OscarConfig(), "online")
    with pytest.raises(OscarInputError, match="lloyd-max"):
        OscarCausalLM(model, OscarConfig(codebook="lloyd-max"), "hadamard")
    with pytest.raises(OscarInputError, match="scale_dtype='float32': expected one of \\('float16', 'float8_e4m3fn'\\)"):
        OscarCausalLM(model, OscarConfig(scale_dtype="float32"), "hadamard")
    with pytest.raises(OscarInputError, match="k_rotation"):
        OscarCausalLM(model, OscarConfig(), random_rotation_set(3, 2, 64, seed=0))
    model.config.model_type = "gpt2"
    with pytest.raises(OscarInputError, match="model_type='gpt2'"):
        OscarCausalLM(model, OscarConfig(), "none")
