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


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    sys.path.insert(0, str(VECTORS))
    import make_vectors

    out = tmp_path_factory.mktemp("vectors")
    make_vectors.build(out)
    return out


def test_cases_cover_the_format():
    configs = [INDEX["cases"][name]["config"] for name in CASES]
    assert {c["k_bits"] for c in configs} == {2, 3, 4}
    assert {c["cluster_dim"] for c in configs} == {32, 64, 128}
    assert {c["codebook"] for c in configs} == {"uniform", "lloyd-max"}
    assert any(c["k_clip"] < 1 for c in configs) and any(c["k_clip"] == 1 for c in configs)
    for name in CASES:
        meta = INDEX["cases"][name]
        cfg = meta["config"]
        # Prefill and decode lengths cross sink -> ring -> body.
        assert meta["tokens"] > cfg["sink"] + cfg["recent"] and meta["prefill"] > cfg["sink"]


@pytest.mark.parametrize("name", CASES)
def test_committed_vectors_equal_the_reference(name, regenerated):
    committed = load_file(str(VECTORS / INDEX["cases"][name]["file"]))
    fresh = load_file(str(regenerated / INDEX["cases"][name]["file"]))
    assert committed.keys() == fresh.keys()
    for key in committed:
        assert committed[key].dtype == fresh[key].dtype, key
        assert torch.equal(committed[key], fresh[key]), key


@pytest.mark.parametrize("name", CASES)
def test_codec_vectors_decode_with_the_numpy_port(name):
    meta = INDEX["cases"][name]
    cfg = meta["config"]
    t = load_file(str(VECTORS / meta["file"]))
    levels = t["cache.k_levels"][0].numpy() if cfg["codebook"] == "lloyd-max" else None
    for row in range(t["codec.input"].shape[0]):
        codes, scales, zeros = quantize_vector(
            t["codec.input"][row].numpy(), cfg["k_bits"], cfg["cluster_dim"], cfg["k_clip"], levels, cfg["scale_dtype"]
        )
        assert t["codec.codes"][row].tolist() == codes.tolist()
        assert t["codec.scale"][row].float().tolist() == scales.astype("float32").tolist()
        assert t["codec.zero"][row].float().tolist() == zeros.astype("float32").tolist()
        lv = levels if levels is not None else range(2 ** cfg["k_bits"])
        unpacked = unpack_vector(codes, cfg["k_bits"], meta["head_dim"])
        groups = [unpacked[i : i + cfg["cluster_dim"]] for i in range(0, meta["head_dim"], cfg["cluster_dim"])]
        f32 = np.float32
        dequant = [f32(z) + f32(s) * f32(lv[c]) for g, s, z in zip(groups, scales, zeros) for c in g]
        assert t["codec.dequant"][row].tolist() == np.array(dequant, dtype=f32).tolist()
