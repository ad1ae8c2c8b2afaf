"""The laptop target: ONNX export, the ONNX Runtime runner (native op and pure-ONNX fallback), the CLI."""

import hashlib
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from bench_checks import check_step_traffic
from model_checks import assert_within_bounds, body_mismatches, layer_body_mismatches
from backends import BACKEND, replay
from native_cases import assert_final_cache, random_case

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto  # noqa: E402

from oscar_export.cli import main  # noqa: E402
from oscar_export.config import OscarConfig  # noqa: E402
from oscar_export.export.graph import CACHE_NAMES, OscarCausalLM, greedy  # noqa: E402
from oscar_export.export.pipeline import export_artifact  # noqa: E402
from oscar_export.targets import get  # noqa: E402
from oscar_export.ops.onnx import DOMAIN, OP  # noqa: E402
from oscar_export.parity import (  # noqa: E402
    ARTIFACT_THRESHOLDS,
    DISTRIBUTION_FLOORS,
    DISTRIBUTION_SHARE,
    run_artifact_parity,
)
from oscar_export.targets.laptop.runner import OrtLM  # noqa: E402
from oscar_export.hf_cache import OscarCache, patch_model_for_kv_quant  # noqa: E402
from oscar_export.models import BUNDLED_MODEL_DIR, load_model  # noqa: E402
from oscar_export.native import ort_op_buildable  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the checkout, whose benchmarks/ a test runs

PROMPT, STEPS, CONTEXT = 100, 64, 200
WINDOWS = dict(sink=16, recent=32)  # the 100-token prompt puts 52 tokens in the packed body
CONFIG = dict(k_bits=2, v_bits=2, cluster_dim=64, **WINDOWS)


needs_native = pytest.mark.skipif("not ort_op_buildable()", reason="liboscar_ort.so needs cmake, g++ and ORT headers")
pytestmark = pytest.mark.usefixtures("single_threaded")


@pytest.fixture(scope="module")
def prompt():
    _, tokenizer = load_model("bundled")
    return tokenizer((BUNDLED_MODEL_DIR / "heldout.txt").read_text(), verbose=False)["input_ids"][:PROMPT]


@pytest.fixture(scope="module")
def reference(prompt):
    """Greedy tokens and the cache after the prompt, from transformers with the reference OscarCache."""
    model, _ = load_model("bundled")
    patch_model_for_kv_quant(model, OscarConfig(**CONFIG), rotations="hadamard")
    ids = torch.tensor([prompt])
    tokens = model.generate(ids, max_new_tokens=STEPS, do_sample=False)[0, PROMPT:].tolist()
    cache = OscarCache(model, max_context=CONTEXT)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return tokens, cache.kv


@pytest.fixture(scope="module")
def float_artifact(tmp_path_factory):
    if not ort_op_buildable():
        pytest.skip("liboscar_ort.so needs cmake, g++ and ORT headers")
    out = tmp_path_factory.mktemp("laptop") / "float"
    export_artifact(get("laptop"), "bundled", out, "hadamard", CONTEXT, float_weights=True,
                    config=OscarConfig(**CONFIG))
    return out


@pytest.mark.float_paths
@pytest.mark.parametrize("runtime", ["onnxruntime", "onnx-fallback"])
def test_greedy_tokens_equal_the_reference(float_artifact, reference, prompt, runtime):
    tokens = OrtLM(float_artifact, runtime, threads=1).generate(prompt, STEPS)
    assert tokens == reference[0]


@pytest.mark.float_paths
@pytest.mark.parametrize("runtime", ["onnxruntime", "onnx-fallback"])
def test_cache_after_prefill_matches_the_reference(float_artifact, reference, prompt, runtime):
    """ONNX Runtime's projections round differently from torch's: body mismatches counted and bounded."""
    lm = OrtLM(float_artifact, runtime, threads=1)
    lm.prefill(prompt)
    got, ref = lm.cache_arrays(), reference[1]
    body = PROMPT - WINDOWS["sink"] - WINDOWS["recent"]
    pairs = [(kind, region, np.stack([got[f"layer{i}.{kind}_{region}"][:, :body] for i in range(4)]),
              torch.stack(list(getattr(ref, region)[kind]))[:, :, :body].numpy())  # codes: a list per layer
             for kind in "kv" for region in ("codes", "scale", "zero")]
    assert_within_bounds(body_mismatches(pairs, {"k": CONFIG["k_bits"], "v": CONFIG["v_bits"]}), runtime)
    for kind in "kv":
        for region in ("sink", "recent"):  # fp16 windows: ONNX Runtime's matmuls round differently
            have = np.stack([got[f"layer{i}.{kind}_{region}"] for i in range(4)]).astype(np.float32)
            want = getattr(ref, region)[kind].numpy().astype(np.float32)
            assert np.allclose(have, want, rtol=2**-10, atol=1e-4), f"{kind}_{region}"


def test_a_decode_step_writes_one_token_in_place(float_artifact, prompt):
    """No per-step copy of the cache: the host's buffers are the op's, and a step changes one token's bytes."""
    lm = OrtLM(float_artifact, "onnxruntime", threads=1)
    lm.prefill(prompt)
    buffers = lm.cache_arrays()
    before = {name: a.copy() for name, a in buffers.items()}
    lm.step([prompt[-1]])
    assert all(lm.cache_arrays()[name] is a for name, a in buffers.items())
    changed = sum(int((a.view(np.uint8) != before[name].view(np.uint8)).sum()) for name, a in buffers.items())
    layers, kv_heads, head_dim, groups = 4, 2, 64, 1
    # The ring is full: per layer, kind and KV head the new fp16 row enters the ring and the oldest
    # ring row leaves for the body (2-bit codes and fp16 scale and zero).
    per_step = layers * 2 * kv_heads * (2 * head_dim + head_dim * 2 // 8 + 2 * 2 * groups)
    cache_bytes = sum(a.nbytes for a in buffers.values())
    assert 0 < changed <= per_step < cache_bytes / 50, (changed, per_step, cache_bytes)


def test_graph_layout(float_artifact):
    checkout = str(Path(__file__).resolve().parents[2]).encode()
    for name in ("model.onnx", "model_fallback.onnx"):  # no stack traces naming this machine's source files
        assert checkout not in (float_artifact / name).read_bytes(), name
    model = onnx.load(float_artifact / "model.onnx", load_external_data=False)
    ops = Counter((n.domain, n.op_type) for n in model.graph.node)
    assert ops[(DOMAIN, OP)] == 4 and [o.name for o in model.graph.output] == ["logits"]
    # The op reads its cache buffers straight from graph inputs: the host's buffers are written in place.
    inputs = {i.name for i in model.graph.input}
    for node in model.graph.node:
        if node.op_type == OP:
            assert all(name in inputs for name in node.input[3:13])
    fallback = onnx.load(float_artifact / "model_fallback.onnx", load_external_data=False)
    assert not any(n.domain == DOMAIN and n.op_type == OP for n in fallback.graph.node)
    assert len(fallback.graph.output) == 1 + 4 * len(CACHE_NAMES) and len(fallback.functions) == 1


# -- the fallback function alone: bit-exact with the reference (golden vectors: tests/ops/test_conformance.py) --


@pytest.mark.float_paths
def test_fallback_function_matches_random_reference_sequences():
    rng = np.random.default_rng(11)
    for i in range(40):
        case = random_case(rng, i, scale_dtypes=("float16", "float8_e4m3fn"))
        worst, cache = replay(BACKEND["onnx-fallback"], case)
        assert worst <= 1e-4, f"{case.name} ({case.config}): {worst:.3g}"
        assert_final_cache(case, cache)


# -- the command line ---------------------------------------------------------------------------


def cli(*args):
    return subprocess.run([sys.executable, "-m", "oscar_export", *args], capture_output=True, text=True, timeout=600)


@needs_native
def test_cli_exports_4bit_weights_and_runs(tmp_path, float_artifact, prompt, capsys):
    out = tmp_path / "int4"
    r = cli("--target", "laptop", "--context", str(CONTEXT), "--sink", "16", "--recent", "32", "--out", str(out),
            "--json")
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    assert manifest["target"] == "laptop" and manifest["config"]["sink"] == 16 and manifest["plan"]["kv_bytes"] > 0
    # The default rotations are OSCAR's, calibrated (here reused from the bundled model's shipped file).
    calibration = manifest["rotations_metadata"]
    assert manifest["rotations"] == "rotations.safetensors" and calibration["method"] == "calibrate"
    assert manifest["config"]["k_clip"] == calibration["k_clip"] and manifest["config"]["v_clip"] == calibration["v_clip"]
    for name, meta in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == meta["sha256"], name
    assert {"model.onnx", "model.onnx.data", "model_fallback.onnx", "liboscar_ort.so", "tokenizer.json"} <= set(
        manifest["files"])
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 4 * 7 + 1  # every linear and lm_head
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert bits == [4] * (4 * 7) + [8]  # the lm_head, last, at 8 bits
    size = (out / "model.onnx.data").stat().st_size
    assert size < 0.5 * (float_artifact / "model.onnx.data").stat().st_size
    tables = {t.name: t.data_type for t in model.graph.initializer}
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in tables]
    assert gathers and all(tables[n.input[0]] == TensorProto.FLOAT16 for n in gathers)  # fp16 embeddings
    assert manifest["plan"]["weights_bytes"] == pytest.approx(size, rel=0.05)  # what the planner promised

    results = {}
    for runtime in ("onnxruntime", "onnx-fallback", "reference"):  # in-process: an interpreter start costs ~10 s
        assert main(["run", "--artifact", str(out), "--prompt", "KING.\nWhat say you", "--max-new-tokens", "16",
                     "--runtime", runtime, "--json", "--threads", "1"]) == 0
        captured = capsys.readouterr()
        results[runtime] = json.loads(captured.out)
        assert len(results[runtime]["tokens"]) <= 16 and isinstance(results[runtime]["text"], str)
        assert ("slower" in captured.err) == (runtime == "onnx-fallback")  # the fallback says so at load
    assert results["onnxruntime"] == results["onnx-fallback"]
    # reference: the eager graph with the artifact's own 4-bit weights, so it says what the runtimes say.
    assert results["reference"] == results["onnxruntime"]

    # parity against the eager graph holding the artifact's own (dequantized 4-bit) weights
    assert main(["parity", "--artifact", str(out), "--prompt-tokens", str(PROMPT), "--steps", "16",
                 "--kl-tokens", "160", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["runtimes"]) == {"onnxruntime", "onnx-fallback"} and "artifact's weights" in report["reference"]
    # int8 activations: the K/V entering the op differ upstream by more than ties; the logits are judged on the
    # probability scale, by the distribution check (docs/parity.md).
    assert report["thresholds"] == {"codes_mismatch_fraction": 5e-3}
    dist = report["distribution"]
    assert dist["activations"] == "rounded activations"
    # a runtime may add a fifth of what the weight format costs against the float model (docs/parity.md)
    assert dist["limits"] == {key: max(floor, DISTRIBUTION_SHARE * dist["weight_format"][key])
                              for key, floor in DISTRIBUTION_FLOORS.items()}
    assert dist["positions"] == 160 and set(dist["runtimes"]) == {"onnxruntime", "onnx-fallback"}
    for name in ("onnxruntime", "onnx-fallback"):
        row, dist_row = report["runtimes"][name], dist["runtimes"][name]
        print(f"{name}: codes mismatch {row['codes_mismatch_fraction']:.2e}, KL mean {dist_row['kl_mean']:.2e}, "
              f"p99.9 {dist_row['kl_p999']:.2e}, top-1 {dist_row['top1_agreement']:.3f}")
        assert row["ok"] and row["tokens_match"] and row["codes_mismatch_fraction"] <= 5e-3, name
        assert dist_row["ok"], name
    gains = report["weight_gains"]
    assert gains["ok"] and gains["tensors"] == 4 * 7 + 2  # every linear, the untied lm_head and the fp16 embeddings
    answers = report["answers"]
    assert answers["model"] == "bundled" and len(answers["questions"]) == 3 and answers["ok"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "foreign.txt").write_text("not an artifact")
    for args, needle in [(["run", "--artifact", str(tmp_path), "--prompt", "x"], "manifest.json"),
                         (["--target", "laptop", "--out", str(tmp_path)], "not an oscar-export artifact"),
                         (["--target", "laptop", "--rotations", "online"], "online"),
                         (["bench", "attention", "--context", "100"], "--context 100")]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
    with pytest.raises(SystemExit) as exit_:  # argparse's own check
        main(["parity", "--artifact", str(tmp_path), "--kl-tokens", "40000"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--kl-tokens: 40000 is out of range: expected 0..32768" in err, err


@needs_native
@pytest.mark.parametrize("scale_dtype", ["float16", "float8_e4m3fn"])
def test_bench_attention_json(capsys, scale_dtype):
    assert main(["bench", "attention", "--runtime", "onnxruntime", "--context", "1024,2048", "--threads", "1",
                 "--scale-dtype", scale_dtype, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["scale_dtype"] == scale_dtype  # and the bytes read below count its scales
    assert [x["context"] for x in report["results"]] == [1024, 2048]
    for x in report["results"]:
        assert x["oscar_ms"] > 0 and x["baseline_ms"] > 0
        assert x["speedup"] == pytest.approx(x["baseline_ms"] / x["oscar_ms"], rel=1e-2)
    check_step_traffic(report)


# -- damaged and edited artifacts: verified before anything native reads them ---------------------


def damaged_copy(artifact, tmp_path, damage):
    out = tmp_path / "copy"
    shutil.copytree(artifact, out)
    damage(out)
    return out


def edit_manifest(**fields):
    def damage(out):
        manifest = json.loads((out / "manifest.json").read_text())
        manifest.update(fields)
        (out / "manifest.json").write_text(json.dumps(manifest))
    return damage


def edit_model(**fields):
    def damage(out):
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["model"].update(fields)
        (out / "manifest.json").write_text(json.dumps(manifest))
    return damage


def zero_bytes(name):
    def damage(out):
        (out / name).write_bytes(bytes((out / name).stat().st_size))
    return damage


def truncate(name):
    def damage(out):
        data = (out / name).read_bytes()
        (out / name).write_bytes(data[: len(data) // 2])
    return damage


@needs_native
@pytest.mark.parametrize("damage, needle", [
    (zero_bytes("model.onnx.data"), "model.onnx.data does not match its sha256"),
    (truncate("liboscar_ort.so"), "liboscar_ort.so is"),
    (lambda out: (out / "model_fallback.onnx").unlink(), "model_fallback.onnx is missing"),
    (edit_manifest(config={"k_bits": 7}), "k_bits=7"),
    (edit_manifest(max_context=10**12), "max_context=1000000000000"),
    (edit_manifest(max_chunk="512"), "max_chunk='512'"),
    (edit_manifest(max_chunk=0), "max_chunk=0"),
    (edit_manifest(files={"../x": {"bytes": 1, "sha256": "0" * 64}}), "expected a path inside the artifact"),
    # Fields no hash covers, in range but not what the program holds: cross-checked against model.onnx.
    (edit_model(layers=5), "its model.layers=5 give 50 cache buffers, the program holds 40"),
    (edit_model(kv_heads=1), "layer0.k_sink (1, "),
    (edit_model(vocab=4097), "model.vocab=4097, the program's logits have 4096"),
    (edit_manifest(eos_token_ids=[]), "eos_token_ids=[]: expected a non-empty list"),
    (edit_manifest(runtime="bogus"), "runtime='bogus': expected 'onnxruntime'"),
])
@pytest.mark.parametrize("command", ["run", "parity"])
def test_damaged_artifact_is_refused_with_one_line(float_artifact, tmp_path, capsys, damage, needle, command):
    out = damaged_copy(float_artifact, tmp_path, damage)
    args = ["--prompt", "KING."] if command == "run" else ["--steps", "2", "--prompt-tokens", "8"]
    assert main([command, "--artifact", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@needs_native
def test_export_keeps_user_files_and_clears_stale_staging(float_artifact, tmp_path, capsys):
    out = damaged_copy(float_artifact, tmp_path, lambda out: (out / "notes.txt").write_text("mine"))
    stale = tmp_path / ".copy.tmp-999999999"  # a killed export's staging folder (no such process)
    stale.mkdir()
    assert main(["--target", "laptop", "--rotations", "hadamard", "--float-weights", "--out", str(out)]) == 2
    assert "holds entries the artifact did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine" and stale.is_dir()  # refused before staging
    (out / "notes.txt").unlink()
    assert main(["--target", "laptop", "--rotations", "hadamard", "--float-weights", "--context", "256",
                 "--out", str(out)]) == 0
    assert not stale.exists() and json.loads((out / "manifest.json").read_text())["max_context"] == 256


@needs_native
def test_flag_values_are_bounded_or_taken_as_text(float_artifact, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--artifact", str(float_artifact), "--prompt", "x", "--threads", "100000"])
    assert exit_info.value.code == 2 and "100000: expected 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--target", "laptop", "--context", str(10**12)])
    assert f"{10**12} tokens: expected at most" in capsys.readouterr().err
    # A prompt that looks like a flag is a prompt.
    assert main(["run", "--artifact", str(float_artifact), "--prompt", "--target", "--max-new-tokens", "2",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) <= 2
    assert main(["run", "--artifact", str(float_artifact), "--prompt", "caf\udce9"]) == 2
    assert "--prompt is not valid UTF-8" in capsys.readouterr().err


@needs_native
def test_run_past_the_context_prints_what_it_generated_and_why_it_stopped(float_artifact, capsys):
    from transformers import AutoTokenizer

    prompt = "KING.\nWhat say you"
    room = CONTEXT - len(AutoTokenizer.from_pretrained(float_artifact)(prompt)["input_ids"])
    assert main(["run", "--artifact", str(float_artifact), "--prompt", prompt, "--max-new-tokens", "5000",
                 "--json"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    eos = json.loads((float_artifact / "manifest.json").read_text())["eos_token_ids"]
    if result["tokens"][-1] in eos:  # the model ended its text first: nothing to say
        assert len(result["tokens"]) <= room and "stopped_at_context" not in result
    else:
        assert len(result["tokens"]) == room and result["stopped_at_context"] == CONTEXT
        assert f"stopped after {room} new tokens: the artifact's context of {CONTEXT} tokens is full" in out.err


def test_an_unexpected_exception_is_an_internal_error_with_a_log(monkeypatch, capsys):
    import oscar_export.cli.commands as cli_module

    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr(cli_module, "cmd_plan", broken)
    assert main(["plan"]) == 1
    err = capsys.readouterr().err
    assert "internal error: KeyError" in err and len(err.strip().splitlines()) == 1
    log = err.split("traceback in ")[1].split(";")[0]
    assert "Traceback" in open(log).read() and "boom" in open(log).read()


def test_a_saved_trace_checks_the_runtimes_elsewhere(float_artifact, tmp_path, capsys):
    trace = tmp_path / "trace.safetensors"
    assert main(["parity", "--artifact", str(float_artifact), "--prompt-tokens", "120", "--steps", "6",
                 "--save-trace", str(trace)]) == 0
    assert "wrote" in capsys.readouterr().out and trace.is_file()
    assert main(["parity", "--artifact", str(float_artifact), "--against", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_tokens"] == 120 and report["steps"] == 6 and str(trace) in report["reference"]
    assert set(report["runtimes"]) == {"reference", "onnxruntime", "onnx-fallback"}
    assert report["thresholds"] == ARTIFACT_THRESHOLDS  # fp32 activations
    assert report["distribution"]["activations"] == "float activations"
    assert report["runtimes"]["reference"]["codes_mismatched"] == 0  # the same eager run, here and in the file
    assert all(row["ok"] and len(row["tokens"]) == 6 for row in report["runtimes"].values())

    # A trace is only checked against the artifact it was recorded on, and it must be a trace.
    from safetensors.numpy import load_file, save_file

    tensors = load_file(trace)
    tensors["tokens"][0] += 1  # another run's tokens: the runtimes now differ from it
    from safetensors import safe_open

    with safe_open(str(trace), "np") as f:
        metadata = f.metadata()
    save_file(tensors, str(tmp_path / "other.safetensors"), metadata=metadata)
    assert main(["parity", "--artifact", str(float_artifact), "--against", str(tmp_path / "other.safetensors"),
                 "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["runtimes"]["onnxruntime"]["tokens_match"]
    save_file(tensors, str(tmp_path / "foreign.safetensors"), metadata={**metadata, "artifact": "0" * 64})
    (tmp_path / "junk.safetensors").write_bytes(b"not a trace")
    for path, needle in ((tmp_path / "foreign.safetensors", "another artifact"), (tmp_path / "junk.safetensors",
                                                                                  "cannot read")):
        assert main(["parity", "--artifact", str(float_artifact), "--against", str(path)]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


@needs_native
@pytest.mark.parametrize("scale_dtype", ["float16", "float8_e4m3fn"])
def test_per_layer_key_bits_run_in_onnx_runtime(tmp_path, prompt, scale_dtype):
    """K's width per layer and fp8 scales (calibrate --budget-bits may choose both): each layer's op and buffers
    take their own width, and the runtimes give the eager module's tokens and, up to counted rounding, its codes
    and scale bits, on the native op and the pure-ONNX fallback alike."""
    mixed = dict(CONFIG, k_bits_by_layer=(2, 3, 4, 2), k_clip_by_layer=(1.0, 0.9, 1.0, 0.8), scale_dtype=scale_dtype)
    manifest = export_artifact(get("laptop"), "bundled", tmp_path / "mixed", "hadamard", CONTEXT, float_weights=True,
                               config=OscarConfig(**mixed))
    assert manifest["config"]["k_bits_by_layer"] == [2, 3, 4, 2] and manifest["config"]["scale_dtype"] == scale_dtype
    fp8 = scale_dtype == "float8_e4m3fn"
    if fp8:
        report = run_artifact_parity(tmp_path / "mixed", prompt[:40], 4)
        assert report["ok"] and set(report["runtimes"]) == {"onnxruntime", "onnx-fallback"}, report
    module = OscarCausalLM(load_model("bundled")[0], OscarConfig(**mixed), "hadamard").eval()
    tokens = greedy(module, torch.tensor([prompt]), 16, CONTEXT)
    cache = module.new_cache(CONTEXT)
    with torch.no_grad():
        module(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), *cache)
    want = {name: t.numpy() for (name, _, _), t in zip(module.cache_spec(CONTEXT), cache)}
    body = PROMPT - WINDOWS["sink"] - WINDOWS["recent"]
    for runtime in ("onnxruntime", "onnx-fallback"):
        assert OrtLM(tmp_path / "mixed", runtime, threads=1).generate(prompt, 16) == tokens, runtime
        lm = OrtLM(tmp_path / "mixed", runtime, threads=1)
        lm.prefill(prompt)
        got = lm.cache_arrays()
        assert got["layer2.k_codes"].shape[-1] == 64 * 4 // 8  # 4-bit K in layer 2
        assert got["layer0.v_zero"].itemsize == (1 if fp8 else 2)
        counts = layer_body_mismatches(got, want, mixed["k_bits_by_layer"], 2, body)
        assert_within_bounds(counts, runtime)


@pytest.mark.float_paths
def test_feedback_rounding_runs_in_onnx_runtime(tmp_path, prompt):
    """K's codes chosen with error feedback: the native op and the pure-ONNX fallback both give the eager module's
    tokens and, up to counted rounding, its codes; and the codes are not those of nearest rounding."""
    from oscar_export.calibration.files import RotationSet, save_rotations
    from oscar_export.calibration.rotations import hadamard_rotations

    rot = hadamard_rotations(4, 64)
    weights = torch.triu(torch.randn(4, 2, 64, 64, generator=torch.Generator().manual_seed(3)) * 0.3, 1)
    path = tmp_path / "feedback.safetensors"
    save_rotations(path, RotationSet(k=rot, v=rot, metadata={"k_rounding": "feedback"}, k_feedback=weights))
    config = dict(CONFIG, k_rounding="feedback")
    manifest = export_artifact(get("laptop"), "bundled", tmp_path / "fb", str(path), CONTEXT, float_weights=True,
                               config=OscarConfig(**config))
    assert manifest["config"]["k_rounding"] == "feedback"
    want = {}
    for rounding in ("feedback", "nearest"):
        module = OscarCausalLM(load_model("bundled")[0], OscarConfig(**dict(config, k_rounding=rounding)),
                               str(path)).eval()
        cache = module.new_cache(CONTEXT)
        with torch.no_grad():
            module(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), *cache)
        want[rounding] = {name: t.numpy() for (name, _, _), t in zip(module.cache_spec(CONTEXT), cache)}
        if rounding == "feedback":
            tokens = greedy(module, torch.tensor([prompt]), 16, CONTEXT)
    body = PROMPT - WINDOWS["sink"] - WINDOWS["recent"]
    nearest = layer_body_mismatches(want["nearest"], want["feedback"], (2,) * 4, 2, body, regions=("codes",))
    assert nearest["codes"][0] > 0.1 * nearest["codes"][1]  # V's codes are the same; a good share of K's move
    for runtime in ("onnxruntime", "onnx-fallback"):
        assert OrtLM(tmp_path / "fb", runtime, threads=1).generate(prompt, 16) == tokens, runtime
        lm = OrtLM(tmp_path / "fb", runtime, threads=1)
        lm.prefill(prompt)
        assert_within_bounds(layer_body_mismatches(lm.cache_arrays(), want["feedback"], (2,) * 4, 2, body), runtime)


@needs_native
def test_parity_fails_a_program_whose_k_rotation_is_wrong_in_one_layer(tmp_path):
    """benchmarks/parity/doctored_parity.py: the program holds the identity as layer 1's K rotation while the artifact's
    rotations file, which the reference reads, is the calibrated one. The codes and the next-token distributions
    both see it; the weights and the answers do not."""
    result = tmp_path / "doctored.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.parity.doctored_parity", "--target", "laptop",
                           "--model", "bundled", "--context", "400", "--doctor", "rotation", "--layer", "1",
                           "--out", str(tmp_path / "artifact"), "--export-flags", "--sink 16 --recent 32",
                           "--parity", "--kl-tokens 368 --prompt-tokens 100 --steps 8", "--json", str(result)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(result.read_text())["parity"]
    assert not report["ok"] and report["weight_gains"]["ok"]
    dist = report["distribution"]
    for name, row in dist["runtimes"].items():
        print(f"{name}: KL mean {row['kl_mean']:.2e} against a limit of {dist['limits']['kl_mean']:.2e}; codes "
              f"{report['runtimes'][name]['codes_mismatch_fraction']:.2e}")
        assert not row["ok"] and row["kl_mean"] > dist["limits"]["kl_mean"], name
        assert not report["runtimes"][name]["ok"], name
