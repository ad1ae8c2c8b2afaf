"""GGUF files as --model: shape from the metadata alone, weights through transformers' GGUF support, one-line
errors for what cannot be read; and a checkpoint directory without weights."""

import dataclasses
import json
import shutil

import pytest
import torch
from gguf_files import write_bundled_gguf

from oscar_export.cli import main
from oscar_export.config import OscarConfig, OscarInputError
from oscar_export.export.pipeline import export_artifact
from oscar_export.run import run_artifact
from oscar_export.targets import get
from oscar_export.models import BUNDLED_MODEL_DIR, load_model, model_shape

TEXT = "KING.\nWhat say you, my lord?"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_bundled_gguf(tmp_path_factory.mktemp("gguf") / "bundled-f32.gguf")


def test_shape_comes_from_the_metadata(gguf_file):
    got, want = dataclasses.asdict(model_shape(str(gguf_file))), dataclasses.asdict(model_shape("bundled"))
    assert {k: v for k, v in got.items() if k != "name"} == {k: v for k, v in want.items() if k != "name"}


@pytest.mark.parametrize("half", [False, True])
def test_weights_and_tokenizer_load_as_the_checkpoint(gguf_file, tmp_path, half):
    path = gguf_file if not half else write_bundled_gguf(tmp_path / "bundled-f16.gguf", half=True)
    model, tokenizer = load_model(str(path))
    reference, reference_tokenizer = load_model("bundled")
    ids = reference_tokenizer(TEXT, return_tensors="pt").input_ids
    assert tokenizer(TEXT, return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    # F32 tensors are the checkpoint's exactly; F16 ones round each weight once (relative 2^-11).
    limit = 0.0 if not half else 2e-2 * float(want.abs().max())
    assert float((got - want).abs().max()) <= limit


def test_an_export_from_gguf_runs_as_the_checkpoint_does(gguf_file, tmp_path):
    config = OscarConfig(k_bits=2, v_bits=2, sink=4, recent=8)
    for name, model in (("gguf", str(gguf_file)), ("bundled", "bundled")):
        manifest = export_artifact(get("laptop"), model, tmp_path / name, "hadamard", 128, float_weights=True, config=config)
        assert manifest["model"]["layers"] == 4
    got = run_artifact(tmp_path / "gguf", TEXT, 12, "onnxruntime", 1)
    assert got == run_artifact(tmp_path / "bundled", TEXT, 12, "onnxruntime", 1)
    assert run_artifact(tmp_path / "gguf", TEXT, 12, "reference")["tokens"] == got["tokens"]


def _one_line_error(capsys, argv, needle):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_bad_model_inputs_are_one_line(gguf_file, tmp_path, capsys):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 3])
    foreign = write_bundled_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    empty = tmp_path / "no-weights"
    empty.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(BUNDLED_MODEL_DIR / name, empty / name)
    _one_line_error(capsys, ["plan", "--model", str(truncated)], "not a readable GGUF file")
    _one_line_error(capsys, ["plan", "--model", str(foreign)], "GGUF architecture 'gpt2' is not supported")
    _one_line_error(capsys, ["plan", "--model", str(tmp_path / "missing.gguf")], "no such GGUF file")
    _one_line_error(capsys, ["calibrate", "--model", str(empty), "--out", str(tmp_path / "r.safetensors")],
                    "no weights")
    with pytest.raises(OscarInputError, match="not a readable GGUF"):
        load_model(str(truncated))


def test_plan_json_of_a_gguf_file(gguf_file, capsys):
    assert main(["plan", "--model", str(gguf_file), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["kv_bytes_per_token"] > 0


def test_a_model_larger_than_memory_is_refused_before_loading(monkeypatch, tmp_path):
    from oscar_export import models

    shape = model_shape("bundled")
    layer = shape.hidden * shape.head_dim * 2 * (shape.q_heads + shape.kv_heads) + 3 * shape.hidden * shape.intermediate
    assert models.fp32_bytes(shape) == 4 * (shape.layers * layer + shape.vocab * shape.hidden)  # tied: one table
    assert sum(p.numel() for p in load_model("bundled")[0].parameters() if p.dim() == 2) * 4 == models.fp32_bytes(shape)
    monkeypatch.setattr(models, "available_memory", lambda: models.fp32_bytes(shape) - 1)
    with pytest.raises(OscarInputError, match=r"GiB in fp32 .* --target laptop \(and android\) streams"):
        load_model("bundled")
    # A streamed export never loads the whole model: the same limit does not stop it.
    manifest = export_artifact(get("laptop"), "bundled", tmp_path / "art", rotations="hadamard", max_context=512)
    assert manifest["target"] == "laptop" and (tmp_path / "art" / "model.onnx").is_file()
    assert models.fp32_bytes(model_shape("llama-3-8b")) / 2**30 == pytest.approx(29.9, abs=0.05)  # 8.03B params
