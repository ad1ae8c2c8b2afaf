"""The bundled default model: loads offline with transformers, is a real trained model, and the report runs on it."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oscar_export.calibration.capture import collect_qkv
from oscar_export.models import BUNDLED_MODEL_DIR, load_model
from oscar_export.report import codec_report


@pytest.fixture(scope="module")
def bundled():
    return load_model("bundled")


def test_files_shape_and_size():
    files = {p.name: p.stat().st_size for p in BUNDLED_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "heldout.txt"} <= set(files)
    assert sum(files.values()) <= 20 * 2**20
    cfg = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["head_dim"] == 64 and cfg["num_hidden_layers"] >= 4


def test_loads_offline_with_plain_transformers(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR)
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    text = "To be, or not to be"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert model.config.model_type == "llama"


def test_held_out_perplexity_matches_the_card(bundled):
    model, tok = bundled
    ids = tok((BUNDLED_MODEL_DIR / "heldout.txt").read_text())["input_ids"][:4 * 256]
    x = torch.tensor(ids).reshape(4, 256)
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss
    ppl = math.exp(loss.item())
    card = (BUNDLED_MODEL_DIR / "README.md").read_text()
    assert "perplexity" in card.lower()
    unigram_vocab = model.config.vocab_size
    assert ppl < unigram_vocab / 20, f"held-out perplexity {ppl:.1f}: the model did not learn"


def test_generates_readable_text(bundled):
    model, tok = bundled
    ids = tok("HAMLET.\nWhat say you, my good lord? I pray you,", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 10
    letters = sum(c.isalpha() or c.isspace() or c in ".,;:'!?-[]" for c in text)
    assert letters / len(text) > 0.95
    assert len({w.strip(".,;:!?[]").lower() for w in words}) >= 6  # not one word repeated


def test_attention_is_sharp(bundled):
    # Trained attention concentrates: mean entropy well below the uniform distribution's.
    model, tok = bundled
    ids = torch.tensor([tok((BUNDLED_MODEL_DIR / "heldout.txt").read_text())["input_ids"][:512]])
    qkv = collect_qkv(model, ids)
    ratios = []
    for q, k, _ in qkv.values():
        k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones(512, 512, dtype=torch.bool).triu(1), -math.inf)
        p = scores.softmax(-1)[:, 256:]
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)
        uniform = torch.log(torch.arange(257, 513, dtype=torch.float32))
        ratios.append((entropy / uniform).mean())
    assert min(ratios) < 0.6


def test_codec_report_on_real_kv():
    report = codec_report("bundled", tokens=400)
    rows = {(r["bits"], r["rotation"]): r for r in report["rows"]}
    for rotation in ("none", "hadamard"):
        errs = [rows[(b, rotation)]["k_rel_error"] for b in (2, 3, 4)]
        assert errs[0] > errs[1] > errs[2] > 0
        attn = [rows[(b, rotation)]["decode_attn_rel_error"] for b in (2, 3, 4)]
        assert attn[0] > attn[2]
    assert all(r["bits_per_element"] > 2 for r in report["rows"])
