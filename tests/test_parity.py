import json
import subprocess
import sys

import torch

from oscar_export.config import OscarConfig
from oscar_export.parity import available_runtimes, compare_ops, generate_trace, replay_trace, run_parity
from oscar_export.hf_cache import patch_model_for_kv_quant
from tiny_models import tiny_model


def test_triton_runs_here_through_the_interpreter():
    assert available_runtimes()["triton"] in ("Triton interpreter on CPU", "Triton on CUDA")


def test_parity_on_a_tiny_model_passes_for_every_runtime():
    report = run_parity(tiny_model("llama"), torch.randint(0, 120, (1, 40)), 5,
                        OscarConfig(sink=4, recent=8, cluster_dim=32), rotations="online")
    assert set(report["runtimes"]) == {"reference", "triton"} and report["ok"]
    triton = report["runtimes"]["triton"]
    assert triton["codes_mismatch_fraction"] == 0 and triton["tokens_match"]
    assert 0 < triton["max_rel_error"] < 1e-5


def test_parity_catches_a_corrupted_cache():
    model = tiny_model("llama")
    patch_model_for_kv_quant(model, cluster_dim=32, rotations="hadamard", sink=4, recent=8)
    prompt = torch.randint(0, 120, (1, 40))
    reference = generate_trace(model, prompt, 3, "reference")
    replay = replay_trace(model, reference, "reference")
    assert compare_ops(replay, reference)["codes_mismatch_fraction"] == 0
    replay.cache.kv.codes["k"][0, 0, 0, 0] ^= 0xFF  # flip four 2-bit codes
    replay.cache.kv.zero["v"][1, 1, 2, 0] += 1
    result = compare_ops(replay, reference)
    assert result["codes_mismatched"] == 4 and not result["windows_scales_zeros_exact"]


def test_parity_command_json():
    r = subprocess.run(
        [sys.executable, "-m", "oscar_export", "parity", "--prompt-tokens", "80", "--steps", "3",
         "--sink", "8", "--recent", "16", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    for name in ("reference", "triton"):
        row = report["runtimes"][name]
        assert row["tokens_match"] and row["codes_mismatch_fraction"] == 0 and row["max_rel_error"] < 1e-3
