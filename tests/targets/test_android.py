"""The android target: the .pte export, the pybindings and TextLLMRunner runners, the example
host, the CLI and the benchmark, against the eager module (the PyTorch reference)."""

import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from bench_checks import check_step_traffic
from memory_checks import check_bench_memory
from model_checks import assert_within_bounds, body_mismatches, layer_body_mismatches
from native_cases import same_bits

pytest.importorskip("executorch.extension.pybindings.portable_lib")

from oscar_export.cli import main  # noqa: E402
from oscar_export.config import OscarConfig, OscarInputError  # noqa: E402
from oscar_export.export.artifact import prompt_ids  # noqa: E402
from oscar_export.export.pipeline import export_artifact  # noqa: E402
from oscar_export.run import reference_trace  # noqa: E402
from oscar_export.targets import get  # noqa: E402
from oscar_export.parity import DISTRIBUTION_FLOORS, DISTRIBUTION_SHARE, compare_artifact_traces  # noqa: E402
from oscar_export.targets.android.lower import LIBRARY_FILE, MODEL_FILE  # noqa: E402
from oscar_export.targets.android.runner import EtLM, kernel_error, stock_runner_generate  # noqa: E402
from oscar_export.export.graph import CACHE_NAMES, OscarCausalLM, greedy  # noqa: E402
from oscar_export.models import BUNDLED_MODEL_DIR, load_model  # noqa: E402
from oscar_export.native import ROOT, executorch_dir  # noqa: E402

PROMPT, STEPS, CONTEXT = 100, 64, 200
WINDOWS = dict(sink=16, recent=32)  # the 100-token prompt puts 52 tokens in the packed body
CONFIG = dict(k_bits=2, v_bits=2, cluster_dim=64, **WINDOWS)
TEXT = "KING.\nWhat say you"


def native_available() -> bool:
    return shutil.which("cmake") is not None and shutil.which("g++") is not None and executorch_dir()[0] is not None


if not native_available():
    pytest.skip("liboscar_executorch.so needs cmake, g++ and the executorch wheel", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_threaded")


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("bundled")[1]


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer((BUNDLED_MODEL_DIR / "heldout.txt").read_text(), verbose=False)["input_ids"][:PROMPT]


@pytest.fixture(scope="module")
def module():
    model, _ = load_model("bundled")
    return OscarCausalLM(model, OscarConfig(**CONFIG), "hadamard").eval()


@pytest.fixture(scope="module")
def reference(module, prompt):
    """Greedy tokens from the eager module, and its cache buffers after the prompt."""
    tokens = greedy(module, torch.tensor([prompt]), STEPS, CONTEXT)
    cache = module.new_cache(CONTEXT)
    with torch.no_grad():
        module(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), *cache)
    names = [name for name, _, _ in module.cache_spec(CONTEXT)]
    return tokens, dict(zip(names, cache))


@pytest.fixture(scope="module")
def float_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("android") / "float"
    export_artifact(get("android"), "bundled", out, "hadamard", CONTEXT, float_weights=True,
                    config=OscarConfig(**CONFIG))
    return out


@pytest.mark.float_paths
def test_greedy_tokens_equal_the_reference(float_artifact, reference, prompt):
    assert EtLM(float_artifact, threads=1).generate(prompt, STEPS) == reference[0]


def test_stock_runner_gives_the_reference_text(float_artifact, module, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]  # the runner tokenizes the text itself, with tokenizer.json
    want = greedy(module, torch.tensor([ids]), 24, CONTEXT)
    got = stock_runner_generate(float_artifact, TEXT, 24)
    assert got["text"] == tokenizer.decode(want)
    # Ids come back from the runner's text pieces; None only where a piece decodes from several ids.
    assert len(got["tokens"]) == len(want) and all(g in (None, w) for g, w in zip(got["tokens"], want))


@pytest.mark.float_paths
def test_cache_after_prefill_matches_the_reference(float_artifact, reference, prompt):
    """K/V come from XNNPACK's fp32 GEMMs, whose summation order differs from torch's: body mismatches
    counted and bounded (docs/format.md, section 7), fp16 windows within their rounding."""
    lm = EtLM(float_artifact, threads=1)
    lm.prefill(prompt)
    got, want = lm.cache_arrays(), reference[1]
    body = PROMPT - WINDOWS["sink"] - WINDOWS["recent"]
    pairs = []
    for layer in range(4):
        for name in CACHE_NAMES:
            have, ref = got[f"cache.{layer}.{name}"], want[f"layer{layer}.{name}"].numpy()
            kind, region = name.split("_", 1)
            if region in ("codes", "scale", "zero"):
                pairs.append((kind, region, have[:, :body], ref[:, :body]))
            elif region in ("sink", "recent"):
                assert np.allclose(have.astype(np.float32), ref.astype(np.float32), rtol=2**-10, atol=1e-3), name
    assert_within_bounds(body_mismatches(pairs, {"k": CONFIG["k_bits"], "v": CONFIG["v_bits"]}), "executorch")


@pytest.mark.float_paths
def test_synthetic_cache_state_decodes_like_the_eager_module(float_artifact, module):
    """bench memory's state (written through the program's own buffers) against the eager module on copies."""
    lm = EtLM(float_artifact, threads=1)
    length = CONTEXT - 5
    lm.fill_synthetic(length, OscarConfig(**CONFIG), np.random.default_rng(1))
    got = lm.cache_arrays()
    assert np.abs(got["cache.3.v_codes"][:, :length - 48]).max() > 0 and lm.length == length
    cache = [torch.from_numpy(got[f"cache.{layer}.{name}"].copy()) for layer in range(4) for name in CACHE_NAMES]
    token = 7
    for step in range(3):
        have = lm.step([token])
        with torch.no_grad():
            want = module(torch.tensor([[token]]), torch.tensor([length + step]), *cache)[0, -1].numpy()
        # Float weights: XNNPACK's and torch's fp32 GEMMs differ in summation order only.
        assert np.abs(have - want).max() <= 1e-3 * np.abs(want).max(), f"step {step}"
        token = int(want.argmax())
    with pytest.raises(OscarInputError, match="fresh runner"):
        lm.fill_synthetic(length, OscarConfig(**CONFIG), np.random.default_rng(1))


def test_bench_memory_measures_the_program(float_artifact):
    check_bench_memory(float_artifact)


def test_runner_metadata(float_artifact):
    program = EtLM(float_artifact).program
    want = {"get_max_seq_len": 200, "get_max_context_len": CONTEXT, "use_kv_cache": True,
            "enable_dynamic_shape": True, "use_sdpa_with_kv_cache": False, "get_bos_id": 0, "get_vocab_size": 4096}
    for name, value in want.items():
        assert program.load_method(name)([]) == [value], name
    assert program.load_method("get_eos_ids")([]) == [1]


def test_kv_bytes_in_the_program_equal_the_plan(float_artifact):
    from executorch.extension.pybindings import portable_lib

    manifest = json.loads((float_artifact / "manifest.json").read_text())
    meta = portable_lib._load_program(str(float_artifact / MODEL_FILE)).method_meta("forward")
    held = sum(meta.attribute_tensor_meta(i).nbytes() for i in range(meta.num_attributes()))
    assert meta.num_attributes() == 4 * len(CACHE_NAMES)
    assert held == manifest["plan"]["kv_bytes"]


# -- bad input ---------------------------------------------------------------------------------


def test_missing_kernel_library_is_named(float_artifact):
    code = ("from oscar_export.targets.android.runner import load_program\n"
            f"load_program({str(float_artifact / MODEL_FILE)!r}).load_method('forward')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"load {LIBRARY_FILE} first" in proc.stderr, proc.stderr[-2000:]


def test_a_program_that_is_not_one_is_refused_before_executorch_reads_it(float_artifact, tmp_path, capsys):
    """Random bytes with a manifest rewritten to match them: ExecuTorch's loader would abort the process."""
    out = tmp_path / "copy"
    shutil.copytree(float_artifact, out)
    (out / MODEL_FILE).write_bytes(np.random.default_rng(0).bytes(4096))
    manifest = json.loads((out / "manifest.json").read_text())
    digest = hashlib.sha256((out / MODEL_FILE).read_bytes()).hexdigest()
    manifest["files"][MODEL_FILE] = {"bytes": 4096, "sha256": digest}
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", "--artifact", str(out), "--prompt", "KING."]) == 2
    err = capsys.readouterr().err
    assert "not an ExecuTorch program" in err and len(err.strip().splitlines()) == 1, err


def test_context_overflow_is_an_error_and_writes_nothing(float_artifact, prompt):
    lm = EtLM(float_artifact, threads=1)
    lm.prefill(prompt)
    with pytest.raises(OscarInputError, match="cache capacity exceeded"):
        lm.step(prompt + prompt[:1])
    # The kernel refuses on its own too: a call past capacity is an error, the cache is untouched.
    before = lm.cache_arrays()
    ids = torch.tensor([prompt[:10]])
    with pytest.raises(RuntimeError):
        lm.method([ids, torch.tensor([CONTEXT - 5])])
    assert "cache capacity exceeded: length 195 + 10 tokens > max_context 200" in kernel_error()
    after = lm.cache_arrays()
    assert all(same_bits(after[name], before[name]) for name in before)


# -- the native example host -------------------------------------------------------------------


def test_example_host_matches_the_pybindings(float_artifact, tokenizer, tmp_path):
    root, _ = executorch_dir()
    build = ROOT / "build" / "android_runner"
    for cmd in (["cmake", "-S", str(ROOT / "examples" / "android_runner"), "-B", str(build),
                 f"-DEXECUTORCH_DIR={root}"], ["cmake", "--build", str(build), "-j", "2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = tokenizer(TEXT)["input_ids"]
    proc = subprocess.run([str(build / "oscar_android_runner"), str(float_artifact / MODEL_FILE),
                           ",".join(map(str, ids)), "24", str(float_artifact / "tokenizer.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens, text = proc.stdout.split("\n", 1)  # "tokens: 1 2 3\ntext: ...\n"; the text may hold newlines
    want = EtLM(float_artifact, threads=1).generate(ids, 24)
    assert tokens.startswith("tokens: ") and [int(t) for t in tokens.split()[1:]] == want
    assert text == f"text: {tokenizer.decode(want)}\n"


# -- the command line --------------------------------------------------------------------------


def cli(*args):
    return subprocess.run([sys.executable, "-m", "oscar_export", *args], capture_output=True, text=True,
                          timeout=1200)


def test_cli_exports_4bit_weights_and_runs(tmp_path, float_artifact, capsys):
    out = tmp_path / "int4"
    r = cli("--target", "android", "--context", str(CONTEXT), "--sink", "16", "--recent", "32", "--out", str(out),
            "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert r.stdout.strip().endswith("}") and manifest["files"]["model.pte"]["sha256"] in r.stdout, r.stdout[:2000]
    assert manifest["target"] == "android" and manifest["config"]["sink"] == 16
    # The default rotations are OSCAR's, calibrated (here reused from the bundled model's shipped file).
    calibration = manifest["rotations_metadata"]
    assert manifest["rotations"] == "rotations.safetensors" and calibration["method"] == "calibrate"
    assert manifest["config"]["k_clip"] == calibration["k_clip"] and manifest["config"]["v_clip"] == calibration["v_clip"]
    for name, meta in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == meta["sha256"], name
    assert {MODEL_FILE, LIBRARY_FILE, "tokenizer.json", "native/CMakeLists.txt", "native/core/oscar_core.h",
            "native/executorch/oscar_et.cc"} <= set(manifest["files"])
    size, float_size = (out / MODEL_FILE).stat().st_size, (float_artifact / MODEL_FILE).stat().st_size
    plan = manifest["plan"]
    assert size < 0.4 * float_size
    # The program holds the weights (the cache is planned memory, not stored); the plan counts XNNPACK's
    # symmetric 4-bit weights (one fp16 scale per group, no zero).
    with capsys.disabled():  # the run commands' JSON is read from capsys below
        print(f"\nmodel.pte: 4-bit {size} bytes, float {float_size} bytes; planner weights {plan['weights_bytes']} "
              f"(ratio {size / plan['weights_bytes']:.4f}), kv {plan['kv_bytes']}")
    assert not plan["weight_zero_points"] and size == pytest.approx(plan["weights_bytes"], rel=0.05)

    results = {}
    for runtime in ("executorch", "stock-runner", "reference"):
        assert main(["run", "--artifact", str(out), "--prompt", TEXT, "--max-new-tokens", "16",
                     "--runtime", runtime, "--json", "--threads", "1"]) == 0
        results[runtime] = json.loads(capsys.readouterr().out)
        assert len(results[runtime]["tokens"]) <= 16
    # One program, two runners: the same text. The reference, the eager graph with the same torchao 4-bit weights,
    # gives the same tokens or differs first at a near tie by parity's rule (its top two logits closer than the
    # logits limit lets a runtime move them): float summation order, torch's threads included, decides those.
    assert results["executorch"]["text"] == results["stock-runner"]["text"]
    got, want = results["executorch"]["tokens"], results["reference"]["tokens"]
    if got != want:
        ids = prompt_ids(AutoTokenizer.from_pretrained(out, local_files_only=True), TEXT)
        trace = reference_trace(out, ids, len(want))
        assert trace["tokens"] == want
        row = compare_artifact_traces({"tokens": got, "logits": None, "codes": None}, trace, manifest["config"],
                                      len(ids))
        assert row["near_tie"] and row["ok"], row

    # parity on the headline artifact: the pybindings on tokens, logits and codes, the stock runner on tokens.
    assert main(["parity", "--artifact", str(out), "--prompt-tokens", str(PROMPT), "--steps", "8", "--kl-tokens", "160",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["runtimes"]) == {"executorch", "stock-runner"} and report["ok"]
    pybind, runner = report["runtimes"]["executorch"], report["runtimes"]["stock-runner"]
    # 8-bit dynamic activations round differently in XNNPACK and in torchao's eager kernels: the logits are judged on
    # the probability scale (docs/parity.md), the codes with the wider limit.
    assert report["thresholds"] == {"codes_mismatch_fraction": 5e-3}
    # Greedy tokens match, or part where the reference's top two are within the tie margin.
    assert (pybind["tokens_match"] or pybind["near_tie"])
    assert pybind["codes_mismatch_fraction"] <= report["thresholds"]["codes_mismatch_fraction"]
    assert (runner["tokens_match"] or runner["near_tie"]) and runner["logits_max_rel_error"] is None
    dist = report["distribution"]
    assert set(dist["runtimes"]) == {"executorch"} and dist["activations"] == "rounded activations"
    assert dist["limits"] == {key: max(floor, DISTRIBUTION_SHARE * dist["weight_format"][key])
                              for key, floor in DISTRIBUTION_FLOORS.items()}
    assert "tokens only" in dist["unavailable"]["stock-runner"] and dist["runtimes"]["executorch"]["ok"]
    answers = report["answers"]
    assert answers["ok"] and all(set(q["answers"]) == {"reference", "executorch", "stock-runner"}
                                 for q in answers["questions"])


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "foreign.txt").write_text("not an artifact")
    for args, needle in [(["--target", "android", "--out", str(tmp_path)], "not an oscar-export artifact"),
                         (["--target", "android", "--rotations", "online"], "online"),
                         (["--target", "android", "--group-size", "0"], "--group-size 0"),
                         (["bench", "attention", "--runtime", "executorch", "--context", "100"], "--context 100")]:
        try:
            code = main(args)
        except SystemExit as exit:  # argparse's own checks end the parser
            code = exit.code
        assert code == 2, args
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)


@pytest.mark.parametrize("scale_dtype", ["float16", "float8_e4m3fn"])
def test_bench_attention_json(capsys, scale_dtype):
    assert main(["bench", "attention", "--runtime", "executorch", "--context", "1024", "--threads", "1",
                 "--scale-dtype", scale_dtype, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["scale_dtype"] == scale_dtype  # and the bytes read below count its scales
    (x,) = report["results"]
    assert x["context"] == 1024 and report["threads"] == 1
    assert x["oscar_ms"] > 0 and x["baseline_ms"] > 0 and x["int8_ms"] > 0
    assert x["speedup"] == pytest.approx(x["baseline_ms"] / x["oscar_ms"], rel=1e-2)
    assert x["speedup_vs_int8"] == pytest.approx(x["int8_ms"] / x["oscar_ms"], rel=1e-2)
    check_step_traffic(report, int8=True)


@pytest.mark.parametrize("scale_dtype", ["float16", "float8_e4m3fn"])
def test_per_layer_key_bits_run_in_executorch(tmp_path, prompt, tokenizer, scale_dtype):
    """K's width per layer and fp8 scales (calibrate --budget-bits may choose both): each layer's kernel call and
    buffers take their own width, and the program gives the eager module's tokens and, up to counted rounding,
    its codes and scale bits."""
    mixed = dict(CONFIG, k_bits_by_layer=(2, 3, 4, 2), k_clip_by_layer=(1.0, 0.9, 1.0, 0.8), scale_dtype=scale_dtype)
    manifest = export_artifact(get("android"), "bundled", tmp_path / "mixed", "hadamard", CONTEXT, float_weights=True,
                               config=OscarConfig(**mixed))
    assert manifest["config"]["k_bits_by_layer"] == [2, 3, 4, 2] and manifest["config"]["scale_dtype"] == scale_dtype
    from executorch.extension.pybindings import portable_lib

    meta = portable_lib._load_program(str(tmp_path / "mixed" / MODEL_FILE)).method_meta("forward")
    held = sum(meta.attribute_tensor_meta(i).nbytes() for i in range(meta.num_attributes()))
    assert held == manifest["plan"]["kv_bytes"]  # the planner counts each layer's width and one-byte fp8 scales
    module = OscarCausalLM(load_model("bundled")[0], OscarConfig(**mixed), "hadamard").eval()
    assert EtLM(tmp_path / "mixed", threads=1).generate(prompt, 16) == greedy(module, torch.tensor([prompt]), 16,
                                                                             CONTEXT)
    cache = module.new_cache(CONTEXT)
    with torch.no_grad():
        module(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), *cache)
    lm = EtLM(tmp_path / "mixed", threads=1)
    lm.prefill(prompt)
    got = {"layer" + name[len("cache."):]: array for name, array in lm.cache_arrays().items()}
    want = {name: t.numpy() for (name, _, _), t in zip(module.cache_spec(CONTEXT), cache)}
    assert got["layer2.k_codes"].shape[-1] == 64 * 4 // 8  # 4-bit K in layer 2
    assert got["layer0.v_zero"].itemsize == (1 if scale_dtype == "float8_e4m3fn" else 2)
    counts = layer_body_mismatches(got, want, mixed["k_bits_by_layer"], 2, PROMPT - WINDOWS["sink"] - WINDOWS["recent"])
    assert_within_bounds(counts, "executorch")
    # bench memory's synthetic state in this format decodes as the eager module does on copies of it.
    lm = EtLM(tmp_path / "mixed", threads=1)
    lm.fill_synthetic(CONTEXT - 5, OscarConfig(**mixed), np.random.default_rng(2))
    state = lm.cache_arrays()
    cache = [torch.from_numpy(state[f"cache.{layer}.{name}"].copy()) for layer in range(4) for name in CACHE_NAMES]
    with torch.no_grad():
        want = module(torch.tensor([[7]]), torch.tensor([CONTEXT - 5]), *cache)[0, -1].numpy()
    assert np.abs(lm.step([7]) - want).max() <= 1e-3 * np.abs(want).max()
    other = "float16" if scale_dtype == "float8_e4m3fn" else "float8_e4m3fn"  # not the artifact's format
    with pytest.raises(OscarInputError, match=f"for scale_dtype='{other}'"):
        EtLM(tmp_path / "mixed", threads=1).fill_synthetic(CONTEXT - 5, OscarConfig(**dict(mixed, scale_dtype=other)),
                                                           np.random.default_rng(2))
