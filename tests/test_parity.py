import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from oscar_export.config import OscarConfig, OscarInputError
from oscar_export.parity.distribution import Distributions, compare, kl_divergence
from oscar_export.parity import (
    TIE_MARGIN,
    _forced_text,
    available_runtimes,
    compare_artifact_traces,
    compare_ops,
    generate_trace,
    replay_trace,
    run_parity,
    tokens_verdict,
)
from oscar_export.hf_cache import patch_model_for_kv_quant
from tiny_models import tiny_model


def test_triton_runs_here_through_the_interpreter():
    assert available_runtimes()["triton"] in ("Triton interpreter on CPU", "Triton on CUDA")


def test_parity_on_a_tiny_model_passes_for_every_runtime():
    # Fixed rotations: each runtime's run estimates online rotations from its own prompt pass, and on this random
    # model a 40-token prompt gives near-degenerate covariances, so the ~5e-5 differences between two passes that
    # occur in about one fresh process in fifteen turn the eigenvectors and move the logits by ~7e-2.
    report = run_parity(tiny_model("llama"), torch.randint(0, 120, (1, 40)), 5,
                        OscarConfig(sink=4, recent=8, cluster_dim=32), rotations="hadamard")
    assert set(report["runtimes"]) == {"reference", "triton"} and report["ok"]
    triton = report["runtimes"]["triton"]
    assert triton["codes_mismatch_fraction"] == 0 and triton["tokens_match"]
    assert 0 < triton["max_rel_error"] < 1e-5


def test_parity_catches_a_corrupted_cache():
    model = tiny_model("llama")
    patch_model_for_kv_quant(model, OscarConfig(cluster_dim=32, sink=4, recent=8), rotations="hadamard")
    prompt = torch.randint(0, 120, (1, 40))
    reference = generate_trace(model, prompt, 3, "reference")
    replay = replay_trace(model, reference, "reference")
    assert compare_ops(replay, reference)["codes_mismatch_fraction"] == 0
    replay.cache.kv.codes["k"][0][0, 0, 0] ^= 0xFF  # flip four 2-bit codes
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


def artifact_trace(tokens, logits, codes):
    return {"tokens": tokens, "logits": [np.asarray(x, np.float32) for x in logits], "codes": {"layer0.k_codes": codes}}


def test_artifact_traces_part_only_at_a_near_tie():
    config = {"k_bits": 2, "v_bits": 2, "sink": 4}
    codes = np.arange(2 * 10 * 4, dtype=np.uint8).reshape(2, 10, 4)  # 10 body slots: positions 4..13
    ref = artifact_trace([3, 1, 2], [[0, 0, 1, 9.0], [0, 5.0, 4.99, 0], [0, 0, 7.0, 0]], codes)
    same = compare_artifact_traces(ref, ref, config, prompt_tokens=8)
    assert same["ok"] and same["tokens_match"] and tokens_verdict(same) == "match" and same["codes_mismatched"] == 0

    # Step 1 parts at a near tie (5.0 against 4.99); what follows reads other tokens and is not compared.
    later = codes.copy()
    later[:, 5:] ^= 0xFF  # body slots 5.. hold positions 9.., after the prompt's 8 tokens and the first step
    tie = artifact_trace([3, 2, 0], [[0, 0, 1, 9.001], [0, 4.995, 4.996, 0], [9, 0, 0, 0]], later)
    row = compare_artifact_traces(tie, ref, config, prompt_tokens=8)
    assert row["ok"] and not row["tokens_match"] and row["near_tie"] and row["diverged_at"] == 1
    assert tokens_verdict(row) == "near tie at step 1" and row["codes_mismatched"] == 0
    assert row["logits_max_abs_error"] < 0.01  # step 2's logits are not compared

    # The same parting where the reference was sure is a failure, and so is a code that differs before it.
    sure = artifact_trace([3, 0, 0], tie["logits"], later)
    assert not compare_artifact_traces(sure, ref, config, prompt_tokens=8)["ok"]
    early = codes.copy()
    early[0, 2, 0] ^= 1
    row = compare_artifact_traces(artifact_trace([3, 2, 0], tie["logits"], early), ref, config, prompt_tokens=8)
    assert not row["ok"] and row["codes_mismatched"] == 1

    # Tokens only (the stock runner): the same rule, from the reference's logits.
    runner = {"tokens": [3, 2, 0], "logits": None, "codes": None}
    assert compare_artifact_traces(runner, ref, config, prompt_tokens=8)["ok"]
    assert not compare_artifact_traces({**runner, "tokens": [3, 0, 0]}, ref, config, prompt_tokens=8)["ok"]


def test_a_runtime_fed_the_reference_tokens_is_checked_at_every_step():
    config = {"k_bits": 2, "v_bits": 2, "sink": 4}
    codes = np.arange(2 * 10 * 4, dtype=np.uint8).reshape(2, 10, 4)
    ref_logits = [[0, 5.0, 4.99, 0], [0, 0, 7.0, 0], [0, 0, 0, 6.0]]
    ref = artifact_trace([1, 2, 3], ref_logits, codes)
    # Step 0 is a near tie the runtime picks the other way; fed the reference's tokens, it reads the same prefix
    # afterwards, so its later steps, logits and codes are held to the reference too.
    tied = artifact_trace([2, 2, 3], [[0, 4.995, 4.996, 0], [0, 0, 7.0, 0], [0, 0, 0, 6.0]], codes)
    row = compare_artifact_traces({**tied, "forced": True}, ref, config, prompt_tokens=8)
    assert row["ok"] and row["forced"] and row["near_tie"] and row["tokens_differing"] == 1
    assert tokens_verdict(row) == "near tie at step 0"

    # A sure difference after the tie: a greedy run stops comparing at the tie and passes; a forced one fails.
    late = artifact_trace([2, 2, 0], tied["logits"][:2] + [[6.5, 0, 0, 6.0]], codes)
    assert compare_artifact_traces(late, ref, config, prompt_tokens=8)["ok"]
    row = compare_artifact_traces({**late, "forced": True}, ref, config, prompt_tokens=8)
    assert not row["ok"] and row["tokens_differing"] == 2
    assert tokens_verdict(row) == "DIFFER at step 2 (the reference leads by 6.00 nats)"

    # Logits and codes after the tie count too.
    row = compare_artifact_traces({**tied, "logits": tied["logits"][:2] + [np.asarray([0, 0, 3.0, 6.0], np.float32)],
                                   "forced": True}, ref, config, prompt_tokens=8)
    assert not row["ok"] and row["logits_max_rel_error"] > 0.1
    later = codes.copy()
    later[:, 9] ^= 0xFF
    row = compare_artifact_traces({**tied, "codes": {"layer0.k_codes": later}, "forced": True}, ref, config,
                                  prompt_tokens=8)
    assert not row["ok"] and row["codes_mismatched"] == 2 * 4 * 4  # 2 heads, 4 bytes of four 2-bit codes

    # Several near ties and nothing else: ok, and counted.
    two = artifact_trace([2, 2, 0], tied["logits"][:2] + [[6.0, 0, 0, 5.99]], codes)
    ref_tie = artifact_trace([1, 2, 3], ref_logits[:2] + [[5.99, 0, 0, 6.0]], codes)
    row = compare_artifact_traces({**two, "forced": True}, ref_tie, config, prompt_tokens=8)
    assert row["ok"] and tokens_verdict(row) == "2 near ties, the first at step 0"


def test_a_near_tie_is_judged_on_the_probability_scale_whatever_the_vocabulary():
    # A 49,152-entry vocabulary of logits around 10 has an L2 norm near 2,200: a rule scaled by it (2% of the norm,
    # the rule this replaces) called a lead of 40 logits, a probability ratio of e^40, a tie. The margin is in nats.
    config = {"k_bits": 2, "v_bits": 2, "sink": 4}
    codes = np.zeros((1, 4, 4), np.uint8)
    logits = np.full(49_152, 10.0, np.float32)
    logits[7], logits[9] = 50.0, 10.0
    ref = {"tokens": [7], "logits": [logits], "codes": {"layer0.k_codes": codes}}
    row = compare_artifact_traces({**ref, "tokens": [9]}, ref, config, prompt_tokens=8)
    assert not row["ok"] and not row["near_tie"] and row["tie_margin"] == 40.0
    for lead, tie in ((TIE_MARGIN - 1e-3, True), (TIE_MARGIN + 1e-3, False)):
        close = logits.copy()
        close[9] = 50.0 - lead
        row = compare_artifact_traces({**ref, "tokens": [9], "logits": [close]}, {**ref, "logits": [close]}, config,
                                      prompt_tokens=8)
        assert row["near_tie"] is tie and row["ok"] is tie, lead


def test_distribution_statistics_against_torch():
    torch.manual_seed(0)
    base_logits, cand_logits = torch.randn(300, 50) * 3, torch.randn(300, 50) * 3
    targets = torch.randint(0, 50, (300,))
    base, cand = Distributions(base_logits.numpy(), targets.numpy()), Distributions(cand_logits.numpy(), targets.numpy())
    # KL(base || candidate) by torch's own definition (input: the candidate's log-probabilities, target: the base's)
    want = torch.nn.functional.kl_div(cand_logits.log_softmax(-1).double(), base_logits.log_softmax(-1).double(),
                                      log_target=True, reduction="none").sum(-1)
    np.testing.assert_allclose(kl_divergence(base, cand), want.numpy(), rtol=1e-5, atol=1e-6)
    row = compare(base, cand)
    assert row["kl_mean"] == pytest.approx(float(want.mean()), rel=1e-4)  # log-probabilities kept in float32
    assert row["kl_p999"] == pytest.approx(float(torch.quantile(want, 0.999)), rel=1e-4)
    assert row["top1_agreement"] == pytest.approx(float((base_logits.argmax(-1) == cand_logits.argmax(-1)).double().mean()))
    nll = torch.nn.functional.cross_entropy(cand_logits, targets)
    assert row["perplexity"] == pytest.approx(float(nll.exp()), rel=1e-5)
    assert row["perplexity_ratio"] == pytest.approx(float(nll.exp() / torch.nn.functional.cross_entropy(base_logits,
                                                                                                      targets).exp()),
                                                 rel=1e-5)
    same = compare(base, base)
    assert same["kl_max"] == 0 and same["top1_agreement"] == 1 and same["perplexity_ratio"] == 1
    with pytest.raises(ValueError, match="different tokens"):
        compare(base, Distributions(cand_logits.numpy(), (targets + 1).numpy() % 50))


def test_the_distribution_text_fits_the_context_and_stops_before_an_eos():
    text = list(range(100, 3000))
    prompt, forced = _forced_text(text, eos=[], max_context=1024, tokens=2048)
    assert prompt == text[:32] and forced == text[32:1024] and len(prompt) + len(forced) == 1024
    prompt, forced = _forced_text(text, eos=[140], max_context=4096, tokens=2048)
    assert forced == text[32:40]
    for eos, context in (([], 32), ([132], 4096)):  # nothing left to score: one line, not a crash in numpy
        with pytest.raises(OscarInputError, match="no position to score"):
            _forced_text(text, eos=eos, max_context=context, tokens=2048)


def test_weights_read_back_are_held_to_the_source_checkpoint():
    import copy

    from oscar_export.export.graph import OscarCausalLM
    from oscar_export.models import load_model
    from oscar_export.parity import WEIGHT_GAIN_LIMIT, weight_gains

    source = OscarCausalLM(load_model("bundled")[0], OscarConfig(), "hadamard").eval()
    rounded = copy.deepcopy(source)
    with torch.no_grad():  # every matrix on an asymmetric 4-bit grid per 32 inputs, as a weight format stores it
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.unflatten(-1, (-1, 32))
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
                step = (hi - lo) / 15
                module.weight.copy_(((w - lo) / step).round().mul(step).add(lo).flatten(-2))
    gains = weight_gains(rounded, source)
    assert gains["ok"] and gains["tensors"] >= 4 * 7 and abs(gains["worst_gain"] - 1) < WEIGHT_GAIN_LIMIT
    assert 0.01 < gains["max_rel_error"] < 0.2
    with torch.no_grad():
        for module in rounded.layers[1].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(1.01)
    gains = weight_gains(rounded, source)
    assert not gains["ok"] and gains["worst"].startswith("layers.1.") and abs(gains["worst_gain"] - 1.01) < 2e-3
    assert weight_gains(source, source) == {"tensors": 0, "worst": None, "worst_gain": None, "max_rel_error": 0.0,
                                            "ok": True}
