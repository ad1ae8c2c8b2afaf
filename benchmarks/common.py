"""What the benchmark scripts share: the machine's description for result files, progress lines, and the quality
harness of the SmolLM2 studies (the validation/test split of the bundled text, 8K perplexity windows and paired
needle retrieval). Scripts import it as `benchmarks.common` (they run as modules from the checkout)."""

from __future__ import annotations

import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from oscar_export.config import OscarConfig
from oscar_export.evaluate.driver import SPLIT_MARGIN, text_tokens
from oscar_export.evaluate.metrics import needle_cases
from oscar_export.evaluate.one_pass import OnePass, chunk_bounds, one_pass_logits
from oscar_export.hf_cache import route_attention
from oscar_export.models import BUNDLED_MODEL_DIR, load_model
from oscar_export.sizes import bits_per_element

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / ".cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # scripts/fetch_smollm2.sh
CONTEXTS = (2048, 4096, 8192)
# evaluate()'s defaults, which the lever sweep runs with
CALIB_TOKENS, CALIB_HELDOUT, WINDOW, CHUNK = 4096, 512, 512, 64
NEEDLE_CONTEXT, NEEDLE_TOKENS, NEEDLE_PREFIX, NEEDLE_DEPTHS = 4096, 24, 8, (0.1, 0.3, 0.5, 0.7, 0.9)
BITS_CONTEXT = 8192


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    load = os.getloadavg()[0]
    return f"{os.cpu_count()}-core {platform.machine()} ({model}), load average {load:.1f} at the start"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def split_text(split: str) -> Path:
    text = (BUNDLED_MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")
    cut = text.index("\n", len(text) // 2) + 1
    path = Path(tempfile.mkdtemp(prefix="oscar-levers-")) / f"{split}.txt"
    path.write_text(text[cut:] if split == "validation" else text[:cut], encoding="utf-8")
    return path


def cluster_bits(cfg: OscarConfig, head_dim: int, clusters: int, context: int) -> float:
    """Bits per K/V element at `context`: the format's, plus log2(C) bits per body token per KV head for K."""
    body = max(context - cfg.sink - cfg.recent, 0)
    return bits_per_element(cfg, head_dim, context) + body * math.log2(clusters) / (context * 2 * head_dim)


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, cache, first: int, rows: int = 1024) -> torch.Tensor:
    """evaluate.token_nll with the LM head applied a slice of positions at a time: the same one-pass
    forward, without holding [8192, vocab] logits and their log-softmax at once (4 GB budget)."""
    n = ids.shape[0]
    with route_attention(model, OnePass(cache, chunk_bounds(n, CHUNK, first))):
        hidden = model.model(input_ids=ids[None], position_ids=torch.arange(n)[None], use_cache=False)
    hidden = hidden.last_hidden_state[0]
    return torch.cat([F.cross_entropy(model.lm_head(hidden[a:min(a + rows, n - 1)]).float(), ids[a + 1:a + rows + 1],
                                      reduction="none") for a in range(0, n - 1, rows)])


@torch.no_grad()
def needle_hits(model, case, cache, first: int) -> str:
    """Per scored repeat token of `case`, in depth order: "1" where greedy prediction is right, else "0"."""
    n = case.ids.shape[0]
    start = min(a for a, _ in case.answers.values()) - 1  # logits at p predict token p + 1
    pred = one_pass_logits(model, case.ids, cache, CHUNK, first, keep_last=n - start).argmax(-1)
    return "".join("".join("1" if hit else "0" for hit in (pred[a - 1 - start:b - 1 - start] == case.ids[a:b]).tolist())
                   for _, (a, b) in sorted(case.answers.items()))


def paired_difference(hits: str, reference: str) -> tuple[float, float]:
    """Mean per-token accuracy difference of `hits` against `reference` (the same tokens) and its standard
    error: both caches answer the same tokens, so the pairs' spread, not each accuracy's, bounds the gap."""
    d = torch.tensor([int(a) - int(b) for a, b in zip(hits, reference, strict=True)], dtype=torch.float64)
    return float(d.mean()), float(d.std() / math.sqrt(len(d)))


def gaps_to_fp16(rows: dict) -> None:
    """Each row's perplexity over rows["fp16"]'s per context (ppl_increase, %) and its needle gap to it, paired per
    token (needle_vs_fp16 and its standard error)."""
    fp16 = rows["fp16"]
    for r in rows.values():
        r["ppl_increase"] = {c: 100 * (r["ppl"][c] / fp16["ppl"][c] - 1) for c in CONTEXTS}
        r["needle_vs_fp16"], r["needle_vs_fp16_se"] = paired_difference(r["needle_hits"], fp16["needle_hits"])


def quality_cells(r: dict) -> str:
    """A row's "ppl 2K | ppl 4K | ppl 8K | needle | gap to fp16" table cells, after gaps_to_fp16."""
    return (" | ".join(f"{r['ppl'][c]:.2f} ({r['ppl_increase'][c]:+.1f}%)" for c in CONTEXTS)
            + f" | {r['needle']:.3f} | {100 * r['needle_vs_fp16']:+.1f} +- {100 * r['needle_vs_fp16_se']:.1f}")


def measure(model, make, cfg, window, cases, needle_length, head_dim, clusters=1) -> dict:
    """Perplexity of the 8K window at each of CONTEXTS and needle accuracy over every sequence of `cases`
    (None: no needle), with the per-token hits that paired_difference compares."""
    t0 = time.perf_counter()
    first = max(cfg.sink + cfg.recent, CHUNK) if cfg else CHUNK
    nll = window_nll(model, window, make(BITS_CONTEXT), first)
    ppl = {c: math.exp(float(nll[:c - 1].mean())) for c in CONTEXTS}
    needle = hits = None
    if cases:
        hits = "".join(needle_hits(model, case, make(needle_length), first) for case in cases)
        needle = hits.count("1") / len(hits)
    bits = 16.0 if cfg is None else cluster_bits(cfg, head_dim, clusters, BITS_CONTEXT)
    return {"bits": bits, "ppl": ppl, "needle": needle, "needle_hits": hits,
            "wall_s": round(time.perf_counter() - t0, 1)}


def load_split(split: str, needle: bool = True, needle_seeds: int = 1):
    """SmolLM2 and one split, as the lever sweep reads them: (model, tokenizer, calibration text, the 8K
    perplexity window, the needle cases (one sequence per seed) or None, a needle sequence's length)."""
    torch.manual_seed(0)
    if not GGUF.is_file():
        sys.exit("fetch the model first: bash scripts/fetch_smollm2.sh")
    model, tokenizer = load_model(str(GGUF))
    calibration_text, ids = text_tokens(tokenizer, split_text(split), CALIB_TOKENS + CALIB_HELDOUT + SPLIT_MARGIN)
    cases = needle_cases(ids, NEEDLE_CONTEXT, NEEDLE_TOKENS, NEEDLE_PREFIX, NEEDLE_DEPTHS, needle_seeds) if needle else None
    return (model, tokenizer, calibration_text, ids[:BITS_CONTEXT], cases,
            NEEDLE_CONTEXT + 2 * len(NEEDLE_DEPTHS) * NEEDLE_TOKENS)
