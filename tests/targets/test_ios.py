"""The ios target: the oscar op as int32-safe Core ML compositions, the converted program checked in numpy
(mil_eval) against the eager graph, the fp16 check, 4-bit weights, the CLI and parity --artifact.

The bundled model is converted once (module fixture, ~1-2 min on 2 cores) through the CLI.
"""

import json
import platform
import sys

import numpy as np
import pytest
import torch

from backends import BACKEND, replay
from native_cases import assert_final_cache, random_case

ct = pytest.importorskip("coremltools")

from oscar_export.cli import main  # noqa: E402
from oscar_export.config import OscarConfig, OscarInputError  # noqa: E402
from oscar_export.targets.ios import lower as ios_lower  # noqa: E402
from oscar_export.ops import coreml as coreml_ops  # noqa: E402
from oscar_export.export.artifact import eager_module, load_manifest  # noqa: E402
from oscar_export.targets.ios.runner import CoreMLLM, coreml_available, load  # noqa: E402
from oscar_export.export.graph import OscarCausalLM  # noqa: E402
from oscar_export.ops.attention import CACHE_NAMES, E4M3_VALUES, op_attributes  # noqa: E402
from oscar_export.export.pipeline import export_artifact  # noqa: E402
from oscar_export.run import reference_trace  # noqa: E402
from oscar_export.targets import get  # noqa: E402
from oscar_export.targets.ios import cache_bits_per_element  # noqa: E402
from oscar_export.targets.ios.mil_eval import MilProgram, saved_program, weights  # noqa: E402
from oscar_export.models import BUNDLED_MODEL_DIR, load_model, model_shape  # noqa: E402
from oscar_export.planner import weight_bytes  # noqa: E402
from model_checks import (BOUNDS, LOGITS_RTOL, assert_within_bounds, body_mismatches, layer_body_mismatches,  # noqa: E402
                          logits_rel_error)
from tiny_models import tiny_model  # noqa: E402

CONTEXT, PROMPT, STEPS = 1024, 400, 32  # sink 64 + recent 256: the prompt puts 80 tokens in the body
LAYERS = 4


@pytest.fixture(scope="module")
def prompt():
    _, tokenizer = load_model("bundled")
    return tokenizer((BUNDLED_MODEL_DIR / "heldout.txt").read_text(), verbose=False)["input_ids"][:PROMPT]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The bundled model exported by the CLI with fp16 weights, context 1024, the cache flags' default format (a
    format flag, so not the format chosen for a device: tests/evaluate/test_budget.py)."""
    out = tmp_path_factory.mktemp("ios") / "f32"
    assert main(["--target", "ios", "--context", str(CONTEXT), "--bits", "2", "--float-weights",
                 "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def reference(artifact, prompt):
    return reference_trace(artifact, prompt, STEPS)


def body_codes_mismatches(lm: CoreMLLM, reference: dict, artifact) -> dict[str, tuple[int, int]]:
    config = json.loads((artifact / "manifest.json").read_text())["config"]
    pairs = [(name.split(".")[1][0], "codes", array, reference["codes"][name])
             for name, array in lm.body_codes().items()]
    return body_mismatches(pairs, {kind: config[f"{kind}_bits"] for kind in "kv"})


# -- the composition alone: bit-exact with the reference op (golden vectors: tests/ops/test_conformance.py) ------


@pytest.mark.float_paths
def test_composition_matches_random_reference_sequences():
    rng = np.random.default_rng(5)
    for i in range(16):
        case = random_case(rng, i, scale_dtypes=("float16", "float8_e4m3fn"))
        worst, cache = replay(BACKEND["coreml-rows"], case)
        assert worst <= 1e-4, f"{case.name} ({case.config}): {worst:.3g}"
        assert_final_cache(case, cache)


@pytest.mark.float_paths
def test_int32_words_unpack_every_bit_pattern():
    """Words with the sign bit set (negative int32) unpack to the format's codes, and pack back."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (64, 48), dtype=np.uint8)
    raw[0] = 0xFF  # all codes 3 / 7 / 15: every word is -1
    raw[1, 3::4] = 0x80  # only the sign bit of each word
    words = torch.from_numpy(raw.view(np.int32).copy())
    from oscar_export.codec import unpack_codes

    for bits in (2, 3, 4):
        want = unpack_codes(torch.from_numpy(raw), bits).to(torch.int32)
        codes = coreml_ops.unpack_words(words, bits)
        assert torch.equal(codes, want), bits
        assert torch.equal(coreml_ops.pack_words(codes, bits), words), bits


def fp8_edge_values() -> torch.Tensor:
    """Every finite E4M3 value, the midpoints between neighbours (ties), one fp32 step either side of each, both
    signs, -0.0, fp32 subnormals and log-spaced values, and magnitudes just past 448."""
    finite = E4M3_VALUES[:127]
    mid = (finite[1:] + finite[:-1]) / 2
    steps = [torch.nextafter(v, torch.tensor(t)) for v in (finite, mid) for t in (-1e9, 1e9)]
    spread = torch.logspace(-44, 2.7, 4001, base=10.0)
    tail = torch.tensor([448.0, 449.0, 464.0, 1e9])
    positive = torch.cat([finite, mid, *steps, spread, tail]).float()
    return torch.cat([positive, -positive, torch.tensor([-0.0, 1e-45, -1e-45])])


@pytest.mark.float_paths
def test_fp8_bytes_round_as_torch_casts():
    """The compare-and-count encoder gives torch's E4M3FN byte for every value up to 448 (ties to even, the sign of
    -0.0) and a NaN byte past it, which apply_rows refuses; the 256-entry table decodes every byte."""
    x = fp8_edge_values()
    got = coreml_ops.fp8_bytes(x)
    inside = x.abs() <= 448
    want = x[inside].to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    assert torch.equal(got[inside], want)
    assert torch.equal(got[~inside], torch.where(x[~inside] < 0, 0xFF, 0x7F).to(torch.int32))
    everything = torch.arange(256, dtype=torch.uint8)
    torch.testing.assert_close(coreml_ops.fp8_values(everything.to(torch.int32)),
                               everything.view(torch.float8_e4m3fn).float(), rtol=0, atol=0, equal_nan=True)


class Fp8Encode(torch.nn.Module):
    """The fp8 scale path alone: values -> bytes, and bytes -> words -> values (3 x 2 bytes in two words, the
    last padded, and 4 x 2 filling them), as the program's outputs."""

    def forward(self, x, words):
        return (coreml_ops.fp8_bytes(x), coreml_ops.fp8_from_words(words, 3, 2),
                coreml_ops.fp8_from_words(words, 4, 2))


def test_fp8_bytes_convert_to_an_integer_program():
    """Converted by coremltools and executed by mil_eval: the same bytes as torch's cast, words decoded in the
    format's order, padded or not, and every op between the comparisons and the bytes integer."""
    coreml_ops.register_coreml_ops()
    x = fp8_edge_values()
    raw = torch.tensor([[0x38, 0xB8, 0x01, 0x7E, 0xFE, 0x80, 0x11, 0x22]], dtype=torch.uint8)
    words = raw.view(torch.int32)
    program = torch.export.export(Fp8Encode(), (x, words)).run_decompositions({})
    assert ios_lower.unsupported_ops(program) == []
    mil = ct.convert(program, convert_to="milinternal", minimum_deployment_target=ct.target.iOS18,
                     compute_precision=ct.precision.FLOAT32)
    names = [var.name for var in mil.functions["main"].outputs]
    out = MilProgram(mil).run({"x": x.numpy(), "words": words.numpy()})
    inside = x.abs() <= 448
    assert np.array_equal(out[names[0]][inside.numpy()],
                          x[inside].to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.int32))
    values = raw.view(torch.float8_e4m3fn).float()
    assert np.array_equal(out[names[1]], values[:, :6].reshape(1, 3, 2).numpy())
    assert np.array_equal(out[names[2]], values.reshape(1, 4, 2).numpy())
    assert ios_lower.packed_float_ops(mil, ["words"], [names[0]]) == []


@pytest.mark.float_paths
def test_fp8_scales_past_448_are_refused_before_the_cache_is_written():
    """A chunk whose group range needs a scale past 448: the rows carry NaN bytes and apply_rows refuses them with
    the codec's message, leaving the app's buffers as they were."""
    cfg = OscarConfig(sink=0, recent=0, cluster_dim=32, scale_dtype="float8_e4m3fn", k_rounding="nearest")
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 2, 32)).astype(np.float16)
    k[0, 1, 0] = 3 * 449  # the second row's scale
    v = np.ones((1, 2, 32), np.float16)
    words = {"k_sink": np.zeros((1, 0, 32), np.float16), "v_sink": np.zeros((1, 0, 32), np.float16),
             "k_recent": np.zeros((1, 0, 32), np.float16), "v_recent": np.zeros((1, 0, 32), np.float16),
             "k_codes": np.zeros((1, 4, 2), np.int32), "v_codes": np.zeros((1, 4, 2), np.int32),
             **{name: np.zeros((1, 1), np.int32) for name in ("k_scale", "k_zero", "v_scale", "v_zero")}}
    levels = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    out, *rows = coreml_ops.attention_rows(
        torch.zeros(1, 2, 32), torch.from_numpy(k.astype(np.float32)).half(), torch.from_numpy(v),
        *(torch.from_numpy(words[name]) for name in CACHE_NAMES), levels, levels, torch.zeros(0),
        torch.tensor([0], dtype=torch.int32), *op_attributes(cfg, 1.0).values())
    rows = {name: r.numpy() for name, r in zip(coreml_ops.ROW_NAMES, rows)}
    assert rows["k_body_scale"][0, 1, 0] == 0x7F
    with pytest.raises(OscarInputError) as err:
        coreml_ops.apply_rows(words, rows, 0, 0, 0)
    from oscar_export.codec import quantize

    with pytest.raises(OscarInputError) as codec_err:
        quantize(torch.from_numpy(k.astype(np.float32)), 2, 32, 1.0, None, "float8_e4m3fn")
    assert str(err.value) == str(codec_err.value) and "max 448" in str(err.value)
    assert all(not array.any() for array in words.values())


# -- the converted program, executed in numpy ---------------------------------------------------


def test_mil_program_matches_the_eager_graph(artifact, prompt, reference):
    lm = CoreMLLM(load(artifact), "coreml-mil", LAYERS, 64, 256, 512)
    tokens, logits = lm.trace(prompt, STEPS)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, reference["logits"]))
    rel = logits_rel_error(logits, reference["logits"])
    print(f"over the prefill and {STEPS - 1} decode steps: max |logits - reference| {diff:.3g}, relative {rel:.3g}")
    assert len(logits) == STEPS and tokens == reference["tokens"]
    assert rel <= LOGITS_RTOL  # numpy's and torch's float sums differ by CPU: measured up to 7e-3 absolute
    # The packed body the app holds against the reference cache: numpy's and torch's float sums round
    # differently on some CPUs, so mismatched codes are counted and bounded (docs/format.md, section 7).
    assert_within_bounds(body_codes_mismatches(lm, reference, artifact), "coreml-mil")


def test_the_program_keeps_packed_words_in_int32(artifact):
    from coremltools.converters.mil.mil.types import builtin_to_string

    program = saved_program(load(artifact))
    main_fn = program.functions["main"]
    for i in range(LAYERS):
        for kind in "kv":
            assert builtin_to_string(main_fn.inputs[f"layer{i}_{kind}_codes"].dtype) == "int32"
    assert ios_lower.packed_float_ops(program, *ios_lower.packed_names(LAYERS)) == []
    # The check walked the unpack of every packed input (>= 2 integer divisions each: bytes, then codes)
    # and the pack of every packed output.
    inputs, outputs = ios_lower.packed_names(LAYERS)
    path = ios_lower.packed_path(program, inputs, outputs)
    divs = [op for op in path if op.op_type == "floor_div"]
    assert len(divs) >= 2 * len(inputs) and all(builtin_to_string(op.outputs[0].dtype) == "int32" for op in divs)
    assert {var.op.name for var in main_fn.outputs if var.name in outputs} <= {op.name for op in path}


class Unpack(torch.nn.Module):
    """The cache's unpack alone: int32 words -> codes, as the program's outputs."""

    def forward(self, words):
        return coreml_ops.unpack_words(words, 2)


def convert_unpack(precision):
    coreml_ops.register_coreml_ops()
    program = torch.export.export(Unpack(), (torch.zeros(2, 8, 4, dtype=torch.int32),)).run_decompositions({})
    return ct.convert(program, convert_to="milinternal", minimum_deployment_target=ct.target.iOS18,
                      compute_precision=precision)


def test_fp16_check_catches_an_unsafe_conversion(monkeypatch):
    """torch.div(..., rounding_mode='floor') goes through fp32 in coremltools and fp16 after its fp16 pass."""
    safe = convert_unpack(ct.precision.FLOAT16)  # our integer op survives the fp16 pass
    assert ios_lower.packed_float_ops(safe, ["words"], []) == []
    monkeypatch.setattr(coreml_ops, "_div", lambda x, d: torch.div(x, coreml_ops._i32(d), rounding_mode="floor"))
    found = ios_lower.packed_float_ops(convert_unpack(ct.precision.FLOAT16), ["words"], [])
    print("unsafe conversion, float ops on packed data:", found)
    assert any(entry.startswith("floor_div") and "fp16" in entry for entry in found), found


def test_mil_eval_runs_the_program_with_its_dtypes():
    """fp16 ops round to fp16 and int32 ops stay int32, as the program declares (not numpy's promotion)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(input_specs=[mb.TensorSpec(shape=(3,), dtype=types.fp16), mb.TensorSpec(shape=(2,), dtype=types.int32)],
                opset_version=ct.target.iOS18)
    def prog(x, w):
        return mb.add(x=x, y=np.float16(1024.0)), mb.floor_div(x=w, y=np.int32(256))

    out = list(MilProgram(prog).run({"x": np.array([0.25, 1, 3], np.float16),
                                     "w": np.array([-(2**31), 2**31 - 1], np.int32)}).values())
    assert out[0].dtype == np.float16 and out[0].tolist() == [1024.0, 1025.0, 1027.0]  # 1024.25 rounds in fp16
    assert out[1].dtype == np.int32 and out[1].tolist() == [-(2**23), 2**23 - 1]


# -- weights, cache size ---------------------------------------------------------------------------


def test_4bit_weights_shrink_the_package_and_still_match_their_eager_graph(artifact, tmp_path, prompt):
    float_model = load(artifact)
    small = ios_lower.compress_weights(float_model, 32)
    small.save(str(tmp_path / "int4.mlpackage"))

    def weights_size(package):
        return (package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").stat().st_size

    # The weight blobs: the program beside them (K feedback rounding unrolls into thousands of ops) is not weights.
    float_size, blob = weights_size(artifact / ios_lower.MODEL_FILE), weights_size(tmp_path / "int4.mlpackage")
    print(f"weight.bin: fp16 weights {float_size / 2**20:.2f} MiB, 4-bit {blob / 2**20:.2f} MiB")
    assert blob < 0.35 * float_size  # 4 bits + an fp16 scale per 32 weights, against 16 bits
    # What the planner counts for an ios export: every matrix (embeddings too) 4-bit symmetric, a tied head once.
    plan = weight_bytes(model_shape("bundled"), 4, embedding_bits=4, group=32, zero_points=False,
                        k_feedback=load_manifest(artifact)["config"]["k_rounding"] == "feedback")
    print(f"weight.bin {blob} bytes, planner {plan['total']}")
    # The blob also holds the graph's other constants (RoPE tables and the like): +6% on this 4-layer model, +2%
    # on SmolLM2-135M; counting the embeddings at fp16, as before, was +40% here.
    assert plan["lm_head"] == 0 and blob == pytest.approx(plan["total"], rel=0.1)
    # The eager graph with the program's own decompressed weights gives the same logits.
    # The artifact's own eager graph: its calibrated rotations are folded into v_proj and o_proj.
    module = eager_module(artifact, load_manifest(artifact))
    program = saved_program(small)
    compressed = [op for op in program.functions["main"].operations if op.op_type == "constexpr_blockwise_shift_scale"]
    assert len(compressed) == LAYERS * 7 + 1  # every projection and the (tied) lm_head
    found = weights(program)
    state = module.state_dict()
    loaded = 0
    for key in state:
        name = "p_" + key.replace(".", "_")
        if name in found:
            step = np.abs(state[key].numpy()).max() / 7
            assert np.abs(found[name] - state[key].numpy()).max() <= step, key  # within one 4-bit step
            loaded += state[key].dim() == 2
            state[key] = torch.from_numpy(found[name].astype(np.float32))
    assert loaded == LAYERS * 7 + 1
    module.load_state_dict(state)
    lm = CoreMLLM(small, "coreml-mil", LAYERS, 64, 256, 512)
    cache, length = module.new_cache(CONTEXT), torch.zeros(1, dtype=torch.int64)
    with torch.no_grad():
        want = module(torch.tensor([prompt[:64]]), length, *cache)[0, -1].numpy()
    got = lm.prefill(prompt[:64])
    assert logits_rel_error([got], [want]) <= LOGITS_RTOL


def test_cache_bits_per_element_at_32k():
    """Bytes the app allocates for the model's cache inputs, against the format's formula."""
    from oscar_export.sizes import bits_per_element

    for model, cfg, head_dim in ((tiny_model("llama"), OscarConfig(), 64),
                                 (tiny_model("llama", head_dim=128), OscarConfig(cluster_dim=128), 128),
                                 (tiny_model("llama", head_dim=128), OscarConfig(cluster_dim=128, sink=16, recent=64),
                                  128),
                                 (tiny_model("llama"), OscarConfig(scale_dtype="float8_e4m3fn", sink=16, recent=32),
                                  64)):
        module = OscarCausalLM(model, cfg, "hadamard")
        layout = ios_lower.cache_inputs(module, 32768)
        got = cache_bits_per_element(layout, 2, 2, head_dim, 32768)
        print(f"head_dim {head_dim}, cluster_dim {cfg.cluster_dim}, sink {cfg.sink} + recent {cfg.recent}, "
              f"{cfg.scale_dtype} scales: "
              f"{got:.4f} bits per K/V element at 32K")
        assert got == pytest.approx(bits_per_element(cfg, head_dim, 32768), rel=1e-12)
    assert got <= 2.3


# -- the command line --------------------------------------------------------------------------------


def test_manifest_and_files(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"] == "ios" and manifest["max_context"] == CONTEXT
    # The default rotations are OSCAR's, calibrated (here reused from the bundled model's shipped file).
    calibration = manifest["rotations_metadata"]
    assert manifest["rotations"] == "rotations.safetensors" and calibration["method"] == "calibrate"
    assert manifest["config"]["k_clip"] == calibration["k_clip"] and manifest["config"]["v_clip"] == calibration["v_clip"]
    names = {io["name"]: io for io in manifest["io"]["inputs"]}
    assert names["layer3_v_codes"] == {"name": "layer3_v_codes", "shape": [2, CONTEXT - 320, 4], "dtype": "int32"}
    assert names["layer0_k_sink"]["dtype"] == "float16"
    import hashlib

    for name, meta in manifest["files"].items():
        assert hashlib.sha256((artifact / name).read_bytes()).hexdigest() == meta["sha256"], name
    assert any(name.startswith("model.mlpackage/") for name in manifest["files"]) and "tokenizer.json" in manifest[
        "files"]
    spec = load(artifact).get_spec()
    assert [f.name for f in spec.description.input] == [io["name"] for io in manifest["io"]["inputs"]]
    assert [f.name for f in spec.description.output] == [io["name"] for io in manifest["io"]["outputs"]]


def test_run_and_parity_commands(artifact, capsys):
    assert main(["run", "--artifact", str(artifact), "--prompt", "KING.\nWhat say you", "--max-new-tokens", "8",
                 "--runtime", "coreml-mil", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert len(run["tokens"]) <= 8 and isinstance(run["text"], str)
    # A short run: test_mil_program_matches_the_eager_graph makes the long comparison.
    code = main(["parity", "--artifact", str(artifact), "--prompt-tokens", "340", "--steps", "3", "--kl-tokens", "200",
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and report["target"] == "ios" and report["prompt_tokens"] == 340
    # fp16 compute over the program's own 4-bit weights, read back for the reference and held to the source's
    dist = report["distribution"]
    assert dist["activations"] == "float activations" and dist["positions"] == 200 and report["weight_gains"]["ok"]
    assert dist["runtimes"]["coreml-mil"]["ok"] and report["answers"]["ok"]
    row = report["runtimes"]["coreml-mil"]
    # parity's own bounds (docs/format.md, section 7): report["ok"] above holds every row to them.
    assert row["ok"] and row["tokens_match"] and row["codes_mismatch_fraction"] <= BOUNDS["codes"]
    assert len(row["tokens"]) == 3 and "artifact's weights" in report["reference"]
    if platform.system() != "Darwin":
        assert "coreml" in report["unavailable"]
        assert main(["run", "--artifact", str(artifact), "--prompt", "KING.", "--runtime", "coreml"]) == 2
        err = capsys.readouterr().err.strip()
        assert "macOS" in err and len(err.splitlines()) == 1, err


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "foreign.txt").write_text("not an artifact")
    for args, needle in [(["--target", "ios", "--out", str(tmp_path)], "not an oscar-export artifact"),
                         (["--target", "ios", "--rotations", "online"], "online"),
                         (["--target", "ios", "--context", "300", "--bits", "2", "--out", str(tmp_path / "a")],
                          "no packed body"),
                         (["--target", "ios", "--recent", "0", "--out", str(tmp_path / "b")], "--recent 0"),
                         (["--target", "ios", "--scale-dtype", "float32", "--out", str(tmp_path / "c")],
                          "scale_dtype='float32': expected 'float16' or 'float8_e4m3fn'"),
                         (["parity", "--artifact", str(tmp_path)], "manifest.json")]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)


def test_unconvertible_operation_names_the_op_and_the_layer():
    class Lgamma(torch.nn.Module):
        def forward(self, x):
            return torch.lgamma(x)

    model = tiny_model("llama", layers=1)
    model.model.layers[0].mlp.act_fn = Lgamma()
    module = OscarCausalLM(model, OscarConfig(sink=4, recent=8), "hadamard").eval()
    with pytest.raises(OscarInputError) as err:
        ios_lower.convert(module, 64, 16, float_weights=True)
    message = str(err.value)
    print(message)
    assert "lgamma" in message and "layers.0.mlp" in message and len(message.splitlines()) == 1, message


# -- macOS: Core ML itself -----------------------------------------------------------------------------


def test_coreml_predict_matches_the_eager_graph(artifact, prompt, reference):
    ok, why = coreml_available()
    if not ok:
        print(f"skipped: {why}", file=sys.stderr)
        pytest.skip(why)
    lm = CoreMLLM(load(artifact), "coreml", LAYERS, 64, 256, 512)
    tokens, logits = lm.trace(prompt, STEPS)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, reference["logits"]))
    print(f"Core ML: max |logits - reference| {diff:.3g}")
    assert tokens == reference["tokens"] and diff < 1e-2
    assert_within_bounds(body_codes_mismatches(lm, reference, artifact), "coreml")


def test_per_layer_key_bits_and_fp8_scales_run_in_the_mil_program(tmp_path, prompt):
    """K's width per layer and fp8 scales (the device default may choose both): each layer's rows and app-held
    words take their own width, fp8 scales and zeros travel as bytes in int32 words, every op on them is integer,
    and the program gives the eager graph's tokens, logits and, up to counted rounding, codes."""
    mixed = dict(k_bits=2, v_bits=2, cluster_dim=32, sink=16, recent=32, k_bits_by_layer=(2, 3, 4, 2),
                 k_clip_by_layer=(1.0, 0.9, 1.0, 0.8), scale_dtype="float8_e4m3fn")
    # context 199: 151 body rows of 2 groups, 302 bytes, so each scale buffer ends in a padded word
    manifest = export_artifact(get("ios"), "bundled", tmp_path / "mixed", "hadamard", 199, float_weights=True,
                               config=OscarConfig(**mixed))
    inputs = {row["name"]: row for row in manifest["io"]["inputs"]}
    assert inputs["layer0_k_scale"]["shape"] == [2, 76] and inputs["layer0_k_scale"]["dtype"] == "int32"
    outputs = {row["name"]: row for row in manifest["io"]["outputs"]}
    assert [outputs[f"layer{i}_k_body_codes"]["shape"][-1] for i in range(LAYERS)] == [64 * b // 32
                                                                                       for b in (2, 3, 4, 2)]
    assert outputs["layer0_v_body_zero"]["shape"] == [2, "T", 2] and outputs["layer0_v_body_zero"]["dtype"] == "int32"
    program = saved_program(load(tmp_path / "mixed"))
    assert ios_lower.packed_float_ops(program, *ios_lower.packed_names(LAYERS, "float8_e4m3fn")) == []
    reference = reference_trace(tmp_path / "mixed", prompt[:100], 8)
    lm = CoreMLLM(load(tmp_path / "mixed"), "coreml-mil", LAYERS, 16, 32, manifest["max_chunk"])
    tokens, logits = lm.trace(prompt[:100], 8)
    assert tokens == reference["tokens"] and logits_rel_error(logits, reference["logits"]) <= LOGITS_RTOL
    counts = layer_body_mismatches(lm.body_codes(), reference["codes"], mixed["k_bits_by_layer"], 2,
                                   regions=("codes",))
    assert_within_bounds(counts, "coreml-mil")
