"""Streamed export (export/streamed.py) and the random checkpoints it is measured on (random_checkpoint.py).

The checkpoints here are Llama-3-8B's architecture narrowed (random_checkpoint's shrink; head_dim 128 and
the head ratio kept) with the bundled tokenizer's vocabulary, so each exports in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from memory_checks import check_bench_memory
from oscar_export.config import OscarConfig, OscarInputError
from oscar_export.export.graph import OscarCausalLM
from oscar_export.export.pipeline import export_artifact
from oscar_export.targets import get
from oscar_export.export.streamed import StreamedWeights, meta_model
from oscar_export.models import load_model, model_shape
from oscar_export.models.random_checkpoint import BUNDLED_VOCAB, checkpoint_config, write_checkpoint
from oscar_export.targets.laptop.lower import MODEL_FILE, export_onnx

NARROW = dict(shrink=8, vocab=BUNDLED_VOCAB)  # hidden 512, 4 q / 1 KV heads of 128, FFN 1792


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "narrow", layers=2, **NARROW)


def test_checkpoint_has_the_preset_shape_and_is_seeded(narrow, tmp_path):
    shape = model_shape(str(narrow))
    assert (shape.layers, shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim, shape.intermediate,
            shape.vocab) == (2, 512, 4, 1, 128, 1792, BUNDLED_VOCAB)
    full = checkpoint_config()
    assert (full["num_hidden_layers"], full["hidden_size"], full["num_key_value_heads"], full["intermediate_size"],
            full["vocab_size"], full["tie_word_embeddings"]) == (32, 4096, 8, 14336, 128256, False)
    index = json.loads((narrow / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 4  # embeddings, one shard per layer, norm + lm_head
    again = write_checkpoint(tmp_path / "again", layers=2, **NARROW)
    other = write_checkpoint(tmp_path / "other", layers=2, seed=1, **NARROW)
    for shard in sorted(set(index.values())):
        assert (narrow / shard).read_bytes() == (again / shard).read_bytes()
        assert (narrow / shard).read_bytes() != (other / shard).read_bytes()
    model, tokenizer = load_model(str(narrow))  # transformers reads it as a checkpoint like any other
    assert model.model.layers[1].self_attn.k_proj.weight.shape == (128, 512)
    assert torch.equal(model.model.norm.weight, torch.ones(512))
    assert 0.015 < model.lm_head.weight.std() < 0.025
    assert max(tokenizer("Once upon a time")["input_ids"]) < shape.vocab


@pytest.mark.parametrize("kwargs, expected", [
    (dict(shrink=3), "--shrink 3"), (dict(vocab=100), "--vocab 100"), (dict(layers=0), "--layers 0"),
    (dict(preset="gpt-9"), "--preset 'gpt-9'"),
])
def test_checkpoint_rejects_bad_arguments(tmp_path, kwargs, expected):
    with pytest.raises(OscarInputError, match=expected):
        write_checkpoint(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_checkpoint_refuses_an_existing_directory(narrow):
    with pytest.raises(OscarInputError, match="exists"):
        write_checkpoint(narrow, layers=1, **NARROW)


def _weights(path):
    """The initializers each MatMulNBits and Gather node reads, in node order."""
    model = onnx.load(path)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weighted = [node for node in model.graph.node
                if node.op_type == "MatMulNBits" or (node.op_type == "Gather" and node.input[0] in init)]
    return [[init[name] for name in node.input if name in init] for node in weighted]


def test_streamed_export_writes_the_in_memory_export_bit_for_bit(narrow, tmp_path):
    config = OscarConfig()
    model, _ = load_model(str(narrow))
    memory = tmp_path / "memory"
    memory.mkdir()
    export_onnx(OscarCausalLM(model, config, "hadamard").eval(), memory, 1024, 64)
    meta, _ = meta_model(narrow)
    module = OscarCausalLM(meta, config, "hadamard").eval()
    streamed = tmp_path / "streamed"
    streamed.mkdir()
    export_onnx(module, streamed, 1024, 64, weights=StreamedWeights(module, meta, narrow))
    a, b = _weights(memory / MODEL_FILE), _weights(streamed / MODEL_FILE)
    assert len(a) == len(b) == 2 * 7 + 2  # 7 matmuls a layer, the lm_head, the embedding lookup
    for x, y in zip(a, b):
        assert len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))


def _flat(tensor):
    """A plain tensor, or the plain tensors a torchao weight is made of (its codes, scales, zero points)."""
    if type(tensor) is torch.Tensor:
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [getattr(tensor, name) for name in names]


def test_android_streamed_weights_equal_the_in_memory_ones(narrow):
    """Quantized part by part as the shards are read: the same torchao weights as quantizing the loaded model,
    and the meta skeleton keeps no weight of its own."""
    pytest.importorskip("torchao")
    from oscar_export.targets.android.lower import quantize_artifact_weights

    config = OscarConfig()
    model, _ = load_model(str(narrow))
    memory = OscarCausalLM(model, config, "hadamard").eval()
    quantize_artifact_weights(memory, 32)
    meta, _ = meta_model(narrow)
    streamed = OscarCausalLM(meta, config, "hadamard").eval()
    quantize_artifact_weights(streamed, 32, StreamedWeights(streamed, meta, narrow))
    a, b = memory.state_dict(), streamed.state_dict()
    assert sorted(a) == sorted(b)
    assert type(b["layers.1.mlp.down_proj.weight"]).__name__ == "IntxUnpackedToInt8Tensor"
    assert b["embed_tokens.weight"].dtype == torch.float16
    for name in a:
        x, y = _flat(a[name]), _flat(b[name])
        assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)), name
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_streamed_export_names_a_missing_tensor(narrow, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in narrow.iterdir():
        (broken / path.name).symlink_to(path)
    index = json.loads((narrow / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (broken / "model.safetensors.index.json").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(OscarInputError, match=r"tensors \['model.layers.1.mlp.up_proj.weight'\] are in no shard"):
        export_artifact(get("laptop"), str(broken), tmp_path / "out", rotations="hadamard", max_context=1024)
    assert not (tmp_path / "out").exists()


def test_planner_matches_the_artifact_and_its_runtime_cache(narrow, tmp_path):
    from oscar_export.targets.laptop.runner import OrtLM

    manifest = export_artifact(get("laptop"), str(narrow), tmp_path / "art", rotations="hadamard", max_context=4096)
    plan = manifest["plan"]
    data = (tmp_path / "art" / "model.onnx.data").stat().st_size
    # MatMulNBits keeps fp32 scales and 4-bit zero points (4.5 bytes a group of 32) where the planner counts
    # 4: 2.5% more linear bytes; embeddings, rotations and norms are exact.
    assert plan["weights_bytes"] <= data <= plan["weights_bytes"] * 1.03
    runtime = OrtLM(tmp_path / "art", threads=1)
    assert sum(a.nbytes for a in runtime.cache.values()) == plan["kv_bytes"]
    check_bench_memory(tmp_path / "art")


# Export peak memory, in a fresh process per depth: the in-memory export held every layer in fp32 (and its
# transposed and quantized copies); streamed, memory is one layer and the embedding table whatever the depth.
_PEAK = """
import resource, sys
from oscar_export.export.pipeline import export_artifact
from oscar_export.targets import get
export_artifact(get("laptop"), sys.argv[1], sys.argv[2], rotations="hadamard", max_context=1024)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_export_peak_memory_is_flat_in_depth(tmp_path):
    peaks, layer_bytes = {}, None
    for layers in (2, 8):
        ckpt = write_checkpoint(tmp_path / f"ckpt{layers}", layers=layers, shrink=4, vocab=BUNDLED_VOCAB)
        shape = model_shape(str(ckpt))
        layer_bytes = 4 * (shape.hidden * shape.head_dim * 2 * (shape.q_heads + shape.kv_heads)
                           + 3 * shape.hidden * shape.intermediate)
        out = subprocess.run([sys.executable, "-c", _PEAK, str(ckpt), str(tmp_path / f"art{layers}")],
                             capture_output=True, text=True, check=True)
        peaks[layers] = int(out.stdout.split()[-1])
    growth = peaks[8] - peaks[2]
    print(f"export peak RSS: 2 layers {peaks[2] / 2**20:.0f} MiB, 8 layers {peaks[8] / 2**20:.0f} MiB; one layer "
          f"in fp32 is {layer_bytes / 2**20:.0f} MiB")
    assert growth < layer_bytes, f"peak grew {growth / 2**20:.0f} MiB from 2 to 8 layers"
