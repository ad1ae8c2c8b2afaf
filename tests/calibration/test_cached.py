"""--rotations calibrate: calibrations cached by what made them, the bundled model's shipped file, bad input."""

import argparse
import json

import pytest

from oscar_export.calibration.cached import cache_key, calibrated_rotations, default_text, read_text
from oscar_export.cli import main
from oscar_export.cli.flags import calibration_config
from oscar_export.config import OscarConfig
from oscar_export.models import BUNDLED_MODEL_DIR
from oscar_export.calibration.files import load_rotations


def error_line(err: str) -> str:
    """The one error line (transformers' weight-loading progress may come before it on stderr)."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


SHIPPED = BUNDLED_MODEL_DIR / "calibration.safetensors"  # scripts/ship_calibrations.py


def test_the_cache_flags_default_config_reuses_the_shipped_calibration():
    # What `oscar-export --target T --rotations calibrate` calibrates for with cache flags at their defaults (K with
    # error feedback).
    config = calibration_config(argparse.Namespace(k_rounding=None), OscarConfig())
    assert config.k_rounding == "feedback"
    path, reused = calibrated_rotations("bundled", config)
    assert reused and path == SHIPPED
    meta = load_rotations(path).metadata
    _, text_sha256 = read_text(default_text())
    assert meta["method"] == "calibrate" and meta["calibration_text_sha256"] == text_sha256
    assert meta["cache_key"] == cache_key("bundled", text_sha256, meta["calibration_tokens"], meta["heldout_tokens"],
                                          config)


def test_a_calibration_is_made_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_EXPORT_CACHE", str(tmp_path))
    config = OscarConfig(k_bits=3, v_bits=3)
    first, reused = calibrated_rotations("bundled", config, tokens=1024, heldout_tokens=128)
    assert not reused and first.parent == tmp_path
    second, reused = calibrated_rotations("bundled", config, tokens=1024, heldout_tokens=128)
    assert reused and second == first and len(list(tmp_path.iterdir())) == 1
    # Sink and recent windows are not searched by the calibration: the same file serves them.
    assert calibrated_rotations("bundled", OscarConfig(k_bits=3, v_bits=3, sink=8, recent=16), tokens=1024,
                                heldout_tokens=128) == (first, True)
    # Another text is another calibration.
    text = tmp_path / "text.txt"
    text.write_text(default_text().read_text()[::-1])
    third, reused = calibrated_rotations("bundled", config, text, tokens=1024, heldout_tokens=128)
    assert not reused and third != first
    assert load_rotations(third).metadata["calibration_text"] == str(text)


def test_a_damaged_cache_entry_is_calibrated_again(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_EXPORT_CACHE", str(tmp_path))
    config = OscarConfig(cluster_dim=32)
    path, _ = calibrated_rotations("bundled", config, tokens=512, heldout_tokens=128)
    path.write_bytes(b"garbage")
    again, reused = calibrated_rotations("bundled", config, tokens=512, heldout_tokens=128)
    assert again == path and not reused and load_rotations(path).metadata["cluster_dim"] == 32


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.write_bytes(b"\xff\xfe caf\xe9"), "is not UTF-8 (byte 0)"),
    (lambda p: p.write_text("too short"), "has 3 tokens: expected at least"),
])
def test_bad_calibration_text_is_one_line_and_exit_2(tmp_path, capsys, make, needle):
    text = tmp_path / "text.txt"
    make(text)
    code = main(["--target", "laptop", "--calibration-text", str(text), "--out", str(tmp_path / "a")])
    assert code == 2 and needle in error_line(capsys.readouterr().err)
    assert not (tmp_path / "a").exists()


def test_rotations_of_another_model_are_one_line_and_exit_2(tmp_path, capsys):
    from oscar_export.calibration.files import RotationSet, save_rotations
    from oscar_export.calibration.rotations import hadamard_rotations

    other = tmp_path / "other.safetensors"
    h = hadamard_rotations(3, 64)  # the bundled model has 4 layers
    save_rotations(other, RotationSet(k=h, v=h, metadata={"objective": "hadamard"}))
    code = main(["--target", "laptop", "--rotations", str(other), "--out", str(tmp_path / "a")])
    assert code == 2 and "layers=3 in the file: expected layers=4" in error_line(capsys.readouterr().err)


def test_calibration_text_needs_calibrate(tmp_path, capsys):
    code = main(["--target", "laptop", "--rotations", "hadamard", "--calibration-text", str(default_text()),
                 "--out", str(tmp_path / "a")])
    assert code == 2 and "--calibration-text is for --rotations calibrate" in capsys.readouterr().err


def test_info_shows_how_the_rotations_were_made(tmp_path, capsys):
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    rotations = load_rotations(SHIPPED)
    (artifact / "manifest.json").write_text(json.dumps({
        "format": "oscar-export/laptop/1", "target": "laptop", "runtime": "onnxruntime",
        "model": {"source": "bundled"}, "weights": "float32", "max_context": 256, "config": {},
        "rotations": "rotations.safetensors", "rotations_metadata": rotations.metadata}))
    assert main(["info", "--artifact", str(artifact), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rotations_metadata"]["method"] == "calibrate"
    assert info["rotations_metadata"]["k_clip"] == rotations.metadata["k_clip"]
