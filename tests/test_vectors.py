"""The committed golden vectors: still what the reference produces, and readable without it."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from numpy_codec import quantize_vector, unpack_vector

VECTORS = Path(__file__).parent / "vectors"
INDEX = json.loads((VECTORS / "index.json").read_text())
CASES = sorted(INDEX["cases"])


# Float tensors rebuilt from the same inputs on another CPU (or with ATEN_CPU_CAPABILITY=default,
# MKL_CBWR=COMPATIBLE) differ in their last bits; measured worst: 3.0e-7 of the tensor's magnitude with
# ATEN_CPU_CAPABILITY=default, 1.0e-6 with MKL_CBWR=COMPATIBLE as well.
FLOAT_RTOL = 1e-5
# End-to-end outputs start from the unrotated originals: where the rotation rounds a value to the
# neighbouring fp16, a code may move, so they get the format's attention tolerance (measured worst 7.1e-5).
END_TO_END = {"cache.prefill_out", "cache.decode_out"}
END_TO_END_RTOL = 1e-3


@pytest.fixture(scope="module")
def make_vectors():
    sys.path.insert(0, str(VECTORS))
    import make_vectors

    return make_vectors


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory, make_vectors):
    out = tmp_path_factory.mktemp("vectors")
    make_vectors.build(out, inputs_from=VECTORS)
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / max(float(want.abs().max()), 1e-30))


def test_cases_cover_the_format():
    configs = [INDEX["cases"][name]["config"] for name in CASES]
    assert {c["k_bits"] for c in configs} == {2, 3, 4}
    assert {c["cluster_dim"] for c in configs} == {32, 64, 128}
    assert {c["codebook"] for c in configs} == {"uniform", "lloyd-max"}
    assert {c.get("k_rounding", "nearest") for c in configs} == {"nearest", "feedback"}
    assert any(c["k_clip"] < 1 for c in configs) and any(c["k_clip"] == 1 for c in configs)
    for name in CASES:
        meta = INDEX["cases"][name]
        cfg = meta["config"]
        # Prefill and decode lengths cross sink -> ring -> body.
        assert meta["tokens"] > cfg["sink"] + cfg["recent"] and meta["prefill"] > cfg["sink"]


def test_every_tensor_has_a_role():
    for name in CASES:
        meta = INDEX["cases"][name]
        names = load_file(str(VECTORS / meta["file"])).keys()
        assert set(meta["tensors"]) == set(names), name
        assert set(meta["tensors"].values()) == {"input", "normative", "float"}, name
        for kind in "qkv":  # the kernel's own inputs are stored, not recomputed
            assert meta["tensors"][f"cache.{kind}_rot"] == "input", name


@pytest.mark.parametrize("name", CASES)
def test_rebuilt_vectors_equal_the_committed(name, rebuilt):
    """Rebuilt from the committed inputs: normative tensors bit for bit, float ones to FLOAT_RTOL."""
    meta = INDEX["cases"][name]
    committed = load_file(str(VECTORS / meta["file"]))
    fresh = load_file(str(rebuilt / meta["file"]))
    assert committed.keys() == fresh.keys()
    for key, role in meta["tensors"].items():
        assert committed[key].dtype == fresh[key].dtype and committed[key].shape == fresh[key].shape, key
        if role == "float":
            bound = END_TO_END_RTOL if key in END_TO_END else FLOAT_RTOL
            assert relative_error(fresh[key], committed[key]) <= bound, key
        else:
            assert torch.equal(committed[key], fresh[key]), key


@pytest.mark.parametrize("name", CASES)
def test_rotated_inputs_are_the_rotated_originals(name, make_vectors):
    """Rotating the stored originals here gives the stored kernel inputs up to float rounding: q within
    FLOAT_RTOL; k/v within one fp16 rounding of their largest value (a small value that is the sum of
    large products can move by several of its own ulps)."""
    meta = INDEX["cases"][name]
    d, _, cfg = make_vectors.CASES[name]
    committed = load_file(str(VECTORS / meta["file"]))
    fresh = make_vectors.rotate_originals(committed, cfg, d)
    assert relative_error(fresh["cache.q_rot"], committed["cache.q_rot"]) <= FLOAT_RTOL
    for key in ("cache.k_rot", "cache.v_rot"):
        differ = int((fresh[key] != committed[key]).sum())
        assert relative_error(fresh[key], committed[key]) <= 2**-11, f"{key}: {differ} values differ"
    if cfg.codebook == "lloyd-max":
        for key, levels in make_vectors.fit_levels(committed, cfg).items():
            assert relative_error(levels, committed[key]) <= FLOAT_RTOL, key


@pytest.mark.parametrize("name", CASES)
def test_codec_vectors_decode_with_the_numpy_port(name):
    meta = INDEX["cases"][name]
    cfg = meta["config"]
    t = load_file(str(VECTORS / meta["file"]))
    levels = t["cache.k_levels"][0].numpy() if cfg["codebook"] == "lloyd-max" else None
    feedback = t["cache.k_feedback"][0, 0].numpy() if cfg.get("k_rounding") == "feedback" else None
    for row in range(t["codec.input"].shape[0]):
        codes, scales, zeros = quantize_vector(
            t["codec.input"][row].numpy(), cfg["k_bits"], cfg["cluster_dim"], cfg["k_clip"], levels, cfg["scale_dtype"],
            feedback,
        )
        assert t["codec.codes"][row].tolist() == codes.tolist()
        assert t["codec.scale"][row].float().tolist() == scales.astype("float32").tolist()
        assert t["codec.zero"][row].float().tolist() == zeros.astype("float32").tolist()
        lv = levels if levels is not None else range(2 ** cfg["k_bits"])
        unpacked = unpack_vector(codes, cfg["k_bits"], meta["head_dim"])
        groups = [unpacked[i : i + cfg["cluster_dim"]] for i in range(0, meta["head_dim"], cfg["cluster_dim"])]
        f32 = np.float32
        dequant = np.array([f32(z) + f32(s) * f32(lv[c]) for g, s, z in zip(groups, scales, zeros) for c in g], f32)
        # docs/format.md: dequantized values agree to 1e-6 relative (a backend may fuse the multiply-add).
        got = t["codec.dequant"][row].numpy()
        assert np.abs(got - dequant).max() <= 1e-6 * max(float(np.abs(dequant).max()), 1e-30)
