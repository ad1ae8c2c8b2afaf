"""`oscar-export bench decode`: both decoders are the bundled model, and the report is consistent."""

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from oscar_export.sizes import cache_bytes  # noqa: E402
from oscar_export.cli import main  # noqa: E402
from oscar_export.config import OscarConfig  # noqa: E402
from oscar_export.export.graph import OscarCausalLM  # noqa: E402
from oscar_export.bench.ort_decode import (Fp32Decoder, bench_decode, fp32_decoder,  # noqa: E402
                                                         save_decoder)
from oscar_export.targets.laptop.runner import OrtLM  # noqa: E402
from oscar_export.models import BUNDLED_MODEL_DIR, load_model  # noqa: E402
from oscar_export.native import ort_op_buildable  # noqa: E402

CONTEXT, STEPS = 1024, 6


@pytest.fixture(scope="module")
def bundled():
    return load_model("bundled")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not ort_op_buildable():
        pytest.skip("liboscar_ort.so needs cmake, g++ and ORT headers")
    work = tmp_path_factory.mktemp("decode")
    return bench_decode([CONTEXT], steps=STEPS, threads=1, work_dir=work, float_weights=True), work


def test_report_shape_and_consistency(report, bundled):
    report, _ = report
    assert report["steps"] == STEPS and report["threads"] == 1 and "float32" in report["weights"]
    (r,) = report["results"]
    assert r["context"] == CONTEXT
    assert r["oscar_tokens_per_s"] > 0 and r["fp32_tokens_per_s"] > 0
    # One set of timings behind every number: speedup = fp32 / oscar, in ms and in tokens/s. The report rounds
    # speed-ups to 3 decimals and rates to 2 (half a unit in the last place: abs 5e-4 and 5e-3).
    assert r["speedup"] == pytest.approx(r["fp32_ms"] / r["oscar_ms"], rel=1e-3, abs=5e-4)
    assert r["speedup"] == pytest.approx(r["oscar_tokens_per_s"] / r["fp32_tokens_per_s"], rel=1e-3, abs=5e-4)
    assert r["speedup_shared"] == pytest.approx(r["fp32_shared_ms"] / r["oscar_ms"], rel=1e-3, abs=5e-4)
    for name in ("oscar", "fp32", "fp32_shared"):
        assert r[f"{name}_tokens_per_s"] == pytest.approx(1e3 / r[f"{name}_ms"], rel=1e-3, abs=5e-3)
    shape = bundled[0].config
    assert r["oscar_cache_bytes"] == cache_bytes(OscarConfig(), shape.num_hidden_layers, shape.num_key_value_heads,
                                                 shape.head_dim, CONTEXT)
    assert r["fp32_cache_bytes"] == 2 * shape.num_hidden_layers * shape.num_key_value_heads * CONTEXT * shape.head_dim * 4


def test_oscar_decode_from_the_synthetic_state_matches_the_eager_module(report, bundled):
    """The artifact the bench timed, from the bench's kind of state, against OscarCausalLM on copies of the buffers."""
    _, work = report
    lm = OrtLM(work / f"oscar-{CONTEXT}", threads=1)
    length = CONTEXT - 300
    lm.fill_synthetic(length, OscarConfig(), np.random.default_rng(1))
    module = OscarCausalLM(bundled[0], OscarConfig(), "hadamard").eval()
    cache = [torch.from_numpy(lm.cache[name].copy()) for name in lm.cache_names]
    token = 7
    for step in range(3):
        got = lm.step([token])
        with torch.no_grad():
            want = module(torch.tensor([[token]]), torch.tensor([length + step]), *cache)[0, -1].numpy()
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), f"step {step}"
        assert int(got.argmax()) == int(want.argmax())
        token = int(want.argmax())


@pytest.mark.parametrize("shared", [False, True])
def test_fp32_decoder_matches_transformers(bundled, tmp_path, shared):
    """An fp32 graph after a real prompt: the next logits of transformers with its own fp32 cache, step by step."""
    model, tokenizer = bundled
    onnx.save(fp32_decoder(model, shared), tmp_path / "fp32.onnx", save_as_external_data=True, location="w.data")
    decoder = Fp32Decoder(tmp_path / "fp32.onnx", threads=1)
    ids = tokenizer((BUNDLED_MODEL_DIR / "heldout.txt").read_text()[:1000])["input_ids"][:40]
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        cache = out.past_key_values
        past = [t.numpy().copy() for layer in cache.layers for t in (layer.keys, layer.values)]
        if shared:  # buffers with room for the steps; rows past the cached tokens must not be read
            room = np.full((1, past[0].shape[1], 8, past[0].shape[3]), 1e4, np.float32)
            past = [np.concatenate([p, room], axis=2) for p in past]
        decoder.start(past, len(ids))
        token = int(out.logits[0, -1].argmax())
        for step in range(3):
            got = decoder.step(token)
            want = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1].numpy()
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), f"step {step}"
            token = int(want.argmax())
            assert int(got.argmax()) == token


def test_context_too_small_is_a_one_line_error(capsys):
    assert main(["bench", "decode", "--runtime", "onnxruntime", "--context", "300", "--steps", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--context 300" in err and "334" in err


def test_quantized_fp32_decoder_has_the_artifacts_weight_format(bundled, tmp_path):
    """The default bench: the fp32-cache graph's weights go through the laptop artifact's quantizer, so every
    weight MatMul is a MatMulNBits with int8 activations, 4-bit but for the 8-bit lm_head; it still decodes."""
    model, _ = bundled
    save_decoder(fp32_decoder(model, shared=True), tmp_path / "q.onnx", float_weights=False)
    graph = onnx.load(tmp_path / "q.onnx").graph
    weights = {t.name for t in graph.initializer}
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    bits = {}
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            attr = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attr["accuracy_level"] == 4 and attr["block_size"] == 32
            bits[node.output[0]] = attr["bits"]
    layers = model.config.num_hidden_layers
    assert len(bits) == 7 * layers + 1 and bits.pop("logits") == 8 and set(bits.values()) == {4}
    decoder = Fp32Decoder(tmp_path / "q.onnx", threads=1)
    heads, d = model.config.num_key_value_heads, model.config.head_dim
    decoder.start([np.zeros((1, heads, 16, d), np.float32) for _ in range(2 * layers)], 0)
    assert np.isfinite(decoder.step(5)).all()
