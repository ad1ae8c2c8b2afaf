"""The command line as a user runs it: a real subprocess, exit codes, one-line errors."""

import json
import subprocess
import sys

import pytest



def run(*args):
    return subprocess.run([sys.executable, "-m", "oscar_export", *args], capture_output=True, text=True, timeout=300)


def test_plan_json():
    r = run("plan", "--model", "llama-2-7b", "--device-memory", "8GB", "--context", "32768", "--weight-bits", "4", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    for key in ("weights_bytes", "kv_bytes_per_token", "kv_bytes_per_token_fp16", "bits_per_element", "max_context", "fits"):
        assert key in p
    assert p["config"]["k_bits"] == 2


def test_plan_table_and_cache_flags():
    r = run("plan", "--model", "qwen2.5-7b", "--context", "65536", "--bits", "3", "--cluster-dim", "128",
            "--sink", "32", "--recent", "128")
    assert r.returncode == 0, r.stderr
    assert "largest context that fits" in r.stdout and "verdict" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", "--model", "gpt-17"], "model 'gpt-17'"),
        (["plan", "--model", "/no/such/dir"], "model '/no/such/dir'"),
        (["plan", "--device-memory", "8XB"], "--device-memory='8XB'"),
        (["plan", "--context", "0"], "--context"),
        (["plan", "--context", "-5"], "--context"),
        (["plan", "--bits", "5"], "--bits"),
        (["plan", "--cluster-dim", "48"], "--cluster-dim"),
        (["plan", "--model", "bundled", "--cluster-dim", "128"], "cluster_dim=128 does not divide head_dim=64"),
        (["plan", "--k-clip", "2"], "k_clip=2.0"),
        (["report", "--text", "/no/such/file.txt"], "text file '/no/such/file.txt'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_config_without_attention_fields(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = run("plan", "--model", str(tmp_path))
    assert r.returncode == 2 and "lacks attention/shape fields" in r.stderr


def test_info_json():
    r = run("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["bundled_model"].endswith("bundled_model") and info["bundled_model_present"]
    assert info["runtimes"]["torch"] is True
    assert set(info["runtimes"]) >= {"onnxruntime", "executorch", "coremltools", "triton"}
    assert "slower" in info["laptop_runtimes"]["onnx-fallback"]


@pytest.mark.parametrize("command", ["plan", "info", "report", "calibrate", "eval", "parity", "rotations", "run", "bench"])
def test_help_on_every_command(command):
    r = run(command, "--help")
    assert r.returncode == 0 and "usage: oscar-export" in r.stdout


def test_calibrate_writes_a_checked_rotation_file(tmp_path):
    out = tmp_path / "rot.safetensors"
    r = run("calibrate", "--out", str(out), "--tokens", "1024", "--heldout-tokens", "256", "--lloyd-max", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["layers"] == 4
    r = run("rotations", "check", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["head_dim"] == 64 and report["max_orthogonality_error"] < 1e-5
    assert report["metadata"]["codebook"] == "lloyd-max"
