"""`bench decode --artifact`: an artifact as shipped, timed after a real prefill; its ONNX Runtime profile; llama.cpp."""

import importlib.util
import statistics
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from oscar_export.cli import main  # noqa: E402
from oscar_export.bench.artifact_decode import LlamaCpp, bench_artifact_decode  # noqa: E402
from oscar_export.export.pipeline import export_artifact  # noqa: E402
from oscar_export.targets import get  # noqa: E402
from oscar_export.models import load_model  # noqa: E402
from oscar_export.report import read_tokens  # noqa: E402
from oscar_export.native import ort_op_buildable  # noqa: E402

CONTEXT = 512
SMOLLM2_GGUF = Path(__file__).resolve().parents[2] / ".cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    if not ort_op_buildable():
        pytest.skip("liboscar_ort.so needs cmake, g++ and ORT headers")
    out = tmp_path_factory.mktemp("bench") / "laptop"
    export_artifact(get("laptop"), "bundled", out, "hadamard", CONTEXT)  # 4-bit weights, as shipped
    return out


def test_report_times_the_artifact_after_a_real_prompt(artifact):
    steps, repeats = 4, 3
    report = bench_artifact_decode(artifact, [400], steps=steps, threads=1, repeats=repeats)
    assert report["target"] == "laptop" and report["runtime"] == "onnxruntime" and "int4" in report["weights"]
    (row,) = report["results"]
    _, tokenizer = load_model("bundled")
    prompt = read_tokens(tokenizer, None, row["prompt_tokens"])  # the bundled text
    assert row["prompt_tokens"] == 400 - (repeats + 1) * steps == prompt.shape[1]
    name = report["oscar"]
    assert list(row["decode_tokens_per_s"]) == [name]  # no --gguf: the artifact alone
    turns = row["decode_turns"][name]
    assert len(turns) == repeats and all(t > 0 for t in turns)
    assert row["decode_tokens_per_s"][name] == pytest.approx(statistics.median(turns), abs=0.01)
    assert row["prefill_tokens_per_s"][name] > 0


def test_profile_counts_every_node_of_a_decode_step(artifact):
    report = bench_artifact_decode(artifact, [300], steps=3, threads=1, repeats=1, profile=True)
    profile = report["results"][0]["profile"]
    graph = onnx.load(artifact / "model.onnx", load_external_data=False).graph
    in_graph = {}
    for node in graph.node:
        in_graph[node.op_type] = in_graph.get(node.op_type, 0) + 1
    layers = load_model("bundled")[0].config.num_hidden_layers
    assert in_graph["OscarAttention"] == layers
    for op in ("OscarAttention", "MatMulNBits"):
        # ONNX Runtime may fuse glue nodes, never these: each runs once per step.
        assert profile["ops"][op]["nodes_per_step"] == in_graph[op], op
        assert profile["ops"][op]["ms"] > 0
    assert profile["step_wall_ms"] >= sum(p["ms"] for p in profile["ops"].values())
    assert profile["other_ms"]["outside the run (bind, copy, argmax)"] >= 0


@pytest.mark.parametrize("argv, expected", [
    (["--context", "4096"], "at most 512"),
    (["--context", "40", "--steps", "16", "--repeats", "2"], "expected more than"),
    (["--gguf", "/nonexistent.gguf"], "--gguf '/nonexistent.gguf' is not a file"),
])
def test_bad_requests_are_one_line_errors(artifact, capsys, argv, expected):
    assert main(["bench", "decode", "--artifact", str(artifact), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err, err


@pytest.mark.parametrize("argv", [["--gguf", "x.gguf"], ["--profile"]])
def test_artifact_flags_need_an_artifact(capsys, argv):
    assert main(["bench", "decode", "--context", "2048", *argv]) == 2
    assert "expected --artifact DIR" in capsys.readouterr().err


def test_attention_bench_takes_no_artifact(artifact, capsys):
    assert main(["bench", "attention", "--artifact", str(artifact)]) == 2
    assert "expected 'bench decode'" in capsys.readouterr().err


def test_llamacpp_greedy_decode_on_the_smollm2_gguf():
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (the optional bench extra)")
    if not SMOLLM2_GGUF.is_file():
        pytest.skip("the SmolLM2 GGUF is not fetched (bash scripts/fetch_smollm2.sh)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name)
    ids = tokenizer("The capital of France is")["input_ids"]
    for cache in ("f16", "q8_0", "q4_0"):
        llm = LlamaCpp(SMOLLM2_GGUF, 64, 1, cache)
        logits = llm.prefill(ids)
        assert logits.shape == (len(tokenizer),)
        assert tokenizer.decode([int(np.argmax(logits))]).strip() == "Paris", cache
        assert np.isfinite(llm.step([int(np.argmax(logits))])).all()
