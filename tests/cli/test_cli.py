"""The command line as a user runs it: a real subprocess, exit codes, one-line errors."""

import json
import shutil
import subprocess
import sys

import pytest

from oscar_export.native import ort_op_buildable



def run(*args):
    return subprocess.run([sys.executable, "-m", "oscar_export", *args], capture_output=True, text=True, timeout=300)


def test_plan_json():
    r = run("plan", "--model", "llama-2-7b", "--device-memory", "8GB", "--context", "32768", "--weight-bits", "4", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    for key in ("weights_bytes", "kv_bytes_per_token", "kv_bytes_per_token_fp16", "bits_per_element", "max_context", "fits"):
        assert key in p
    assert p["config"]["k_bits"] == 2


def test_plan_with_fp8_scales_counts_one_byte_each():
    """Llama-3-8B's shape (head_dim 128, group 64): fp8 scale and zero save 2 * 2 * 2 bytes per KV head and token
    of the body, a quarter bit per element."""
    plans = {}
    for dtype in ("float16", "float8_e4m3fn"):
        r = run("plan", "--model", "llama-3-8b", "--context", "32768", "--scale-dtype", dtype, "--json")
        assert r.returncode == 0, r.stderr
        plans[dtype] = json.loads(r.stdout)
    fp16, fp8 = plans["float16"], plans["float8_e4m3fn"]
    assert fp8["config"]["scale_dtype"] == "float8_e4m3fn"
    body = 32768 - 64 - 256
    assert fp16["kv_bytes"] - fp8["kv_bytes"] == 32 * 8 * body * 2 * 2 * 2
    assert abs(fp16["bits_per_element"] - fp8["bits_per_element"] - 0.25 * body / 32768) < 1e-9


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
        (["plan", "--scale-dtype", "int8"], "--scale-dtype"),
        (["--target", "laptop", "--scale-dtype", "float8"], "--scale-dtype: invalid choice"),
        (["--target", "ios", "--scale-dtype", "bfloat16"],
         "scale_dtype='bfloat16': expected 'float16' or 'float8_e4m3fn'"),
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
    assert "slower" in info["targets"]["laptop"]["run_runtimes"]["onnx-fallback"]
    assert set(info["targets"]) == {"android", "ios", "laptop"}
    kernels = info["native_kernels"]  # None only where the set-up could not build the core
    assert kernels is not None or shutil.which("cmake") is None or shutil.which("g++") is None
    if kernels is not None:
        assert kernels["decode"] == (kernels["available"] or [""])[0]  # the fastest set, unless OSCAR_SIMD says


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


@pytest.fixture(scope="module")
def head_dim_32_checkpoint(tmp_path_factory):
    """A Llama checkpoint with head_dim 32 (hidden 256, 8 heads): only cluster_dim 32 tiles it."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_export.models import BUNDLED_MODEL_DIR

    out = tmp_path_factory.mktemp("head_dim_32")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=512, vocab_size=4096, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the bundled tokenizer fits vocab 4096
        shutil.copy(BUNDLED_MODEL_DIR / name, out / name)
    return out


def test_head_dim_32_calibrates_and_plans_with_no_flag(head_dim_32_checkpoint, tmp_path):
    model = str(head_dim_32_checkpoint)
    r = run("plan", "--model", model, "--context", "512", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["config"]["cluster_dim"] == 32
    rot = tmp_path / "rot.safetensors"
    r = run("calibrate", "--model", model, "--out", str(rot), "--tokens", "512", "--heldout-tokens", "128",
            "--zoo-out", str(tmp_path / "zoo"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "zoo").iterdir()) == ["k_rotation_qqt_h_pbr.pt",
                                                                   "v_rotation_sst_h_pbr.pt"]
    r = run("rotations", "check", str(rot), "--json")
    meta = json.loads(r.stdout)["metadata"]
    assert meta["cluster_dim"] == 32 and meta["head_dim"] == 32
    # The official pair converts back to the same rotations.
    again = tmp_path / "again.safetensors"
    r = run("rotations", "convert", "--k", str(tmp_path / "zoo" / "k_rotation_qqt_h_pbr.pt"),
            "--v", str(tmp_path / "zoo" / "v_rotation_sst_h_pbr.pt"), "--out", str(again))
    assert r.returncode == 0, r.stderr[-2000:]
    import torch

    from oscar_export.calibration.files import load_rotations

    assert torch.equal(load_rotations(again).k, load_rotations(rot).k)


@pytest.mark.skipif(not ort_op_buildable(), reason="the laptop export needs cmake, g++ and ONNX Runtime headers")
def test_head_dim_32_exports_with_no_flag(head_dim_32_checkpoint, tmp_path):
    r = run("--target", "laptop", "--model", str(head_dim_32_checkpoint), "--context", "256", "--float-weights",
            "--out", str(tmp_path / "artifact"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["config"]["cluster_dim"] == 32


@pytest.mark.skipif(not ort_op_buildable(), reason="the laptop export needs cmake, g++ and ONNX Runtime headers")
def test_export_takes_the_rounding_and_scale_flags(head_dim_32_checkpoint, tmp_path):
    """--k-rounding and --scale-dtype reach the artifact's config over the calibration's choice, the pure-ONNX
    fallback graph's included: its scale and zero inputs hold fp8 bits too."""
    r = run("--target", "laptop", "--model", str(head_dim_32_checkpoint), "--context", "256", "--float-weights",
            "--k-rounding", "nearest", "--scale-dtype", "float8_e4m3fn", "--out", str(tmp_path / "artifact"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads(r.stdout)
    assert manifest["config"]["k_rounding"] == "nearest" and manifest["config"]["scale_dtype"] == "float8_e4m3fn"
    assert {"model.onnx", "model_fallback.onnx"} <= set(manifest["files"])
    import onnx  # the laptop export's own dependency, there whenever it ran

    fallback = onnx.load(tmp_path / "artifact" / "model_fallback.onnx", load_external_data=False)
    scales = [v for v in fallback.graph.input if v.name.endswith(("_scale", "_zero"))]
    assert scales and all(v.type.tensor_type.elem_type == onnx.TensorProto.UINT8 for v in scales)


# Every subcommand with bad inputs: one error line, exit 2, no traceback (in-process, so it is quick).
BAD_INPUTS = [
    ["plan", "--model", "/no/such/dir"], ["plan", "--context", "0"], ["plan", "--device-memory", "8XB"],
    ["info", "--artifact", "/no/such/dir"],
    ["report", "--model", "/no/such/dir"], ["report", "--text", "/no/such/file.txt"],
    ["calibrate", "--out", "/proc/x.safetensors", "--tokens", "64"], ["calibrate", "--out", "x.safetensors",
                                                                      "--text", "/no/such/file.txt"],
    ["eval", "--model", "/no/such/dir"], ["eval", "--contexts", "abc"],
    ["parity", "--artifact", "/no/such/dir"], ["parity", "--rotations", "/no/such/file.safetensors"],
    ["rotations", "convert", "--k", "/no/k.pt", "--v", "/no/v.pt", "--out", "x.safetensors"],
    ["rotations", "check", "/no/such/file.safetensors"],
    ["run", "--artifact", "/no/such/dir", "--prompt", "x"], ["run", "--artifact", "/tmp", "--prompt", "x",
                                                              "--threads", "-1"],
    ["run", "--artifact", "/tmp", "--prompt", ""], ["run", "--artifact", "/tmp", "--chat", ""],
    ["run", "--artifact", "/tmp", "--prompt", "x", "--max-new-tokens", str(10**12)],
    ["parity", "--steps", "100000000", "--prompt-tokens", "16"], ["parity", "--prompt-tokens", str(10**9)],
    ["bench", "attention", "--context", "abc"], ["bench", "attention", "--threads", "100000"],
    ["bench", "decode", "--steps", "100000000"],
    ["--target", "laptop", "--model", "/no/such/dir"], ["--target", "android", "--context", "0"],
    ["--target", "ios", "--out", "/proc/x"], ["--target", "laptop", "--rotations", "/no/such/file.safetensors"],
]


@pytest.mark.parametrize("argv", BAD_INPUTS, ids=lambda argv: " ".join(argv[:3]))
def test_every_command_answers_bad_input_in_one_line(argv, capsys):
    from oscar_export.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
