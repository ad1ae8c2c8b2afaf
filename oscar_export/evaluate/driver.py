"""eval's driver: the text split, the methods built once, every metric at every context."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..calibration.capture import collect_qkv
from ..config import OscarConfig, OscarInputError
from ..hf_cache import attention_shape
from ..progress import note
from .baselines import Fp16Cache, bits_at
from .methods import build_methods
from .metrics import attention_errors, needle_accuracy, needle_cases, token_nll
from .specs import DEFAULT_LONGEST_CONTEXT, DEFAULT_METHODS, METRICS, method_config


# Tokens reserved after the calibration text, so re-tokenizing its decoded form never runs short.
SPLIT_MARGIN = 16


def text_tokens(tokenizer, text_path: Path, reserve: int) -> tuple[str, torch.Tensor]:
    if not text_path.is_file():
        raise OscarInputError(f"text file {str(text_path)!r} does not exist: expected a UTF-8 text file")
    # verbose=False: a long text is expected here, it is cut into windows
    ids = tokenizer(text_path.read_text(encoding="utf-8", errors="replace"), verbose=False)["input_ids"]
    if len(ids) <= reserve:
        raise OscarInputError(
            f"text file {str(text_path)!r} has {len(ids)} tokens: expected more than the {reserve} reserved for calibration"
        )
    calibration = tokenizer.decode(ids[:reserve], skip_special_tokens=True)
    return calibration, torch.tensor(ids[reserve:])


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OscarInputError(f"{name}={value!r}: expected a positive integer")


def evaluate(
    model_name_or_path: str = "bundled",
    methods: Sequence[str] = DEFAULT_METHODS,
    config: OscarConfig | None = None,
    rotations=None,
    contexts: Sequence[int] | None = None,
    *,
    text: str | Path | None = None,
    metrics: Sequence[str] = METRICS,
    chunk: int = 64,
    prefill: int | None = None,
    ppl_tokens: int = 4096,
    attn_tokens: int = 1024,
    decode_tokens: int = 16,
    needle_context: int | None = None,
    needle_tokens: int = 24,
    needle_prefix: int = 8,
    needle_depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    needle_seeds: int = 1,
    calibration_tokens: int = 4096,
    calibration_heldout: int = 512,
    match_clip: bool = False,
    per_head: bool = False,
    model=None,
    tokenizer=None,
) -> dict:
    """Perplexity, attention error and needle retrieval of each method's cache (see the module docstring).

    methods: specs, see method_config (e.g. oscar, oscar-3, kivi-k3v2). config: the cache format of every
    quantized method without bits of its own (default OscarConfig()). rotations: a rotation file (or
    RotationSet) for `oscar`; None calibrates on the reserved first part of the text. contexts:
    perplexity context lengths: windows of the longest one, ppl_tokens of text in all (whole windows, at
    least one); a shorter context's perplexity is that of the windows' first tokens. Default: P/4, P/2
    and P, P the model's max_position_embeddings up to DEFAULT_LONGEST_CONTEXT (2048 when it has none);
    needle_context defaults to P/2. prefill: first chunk
    (default sink + recent, which only ever reads fp16, so it changes nothing but gives `online` a
    prompt to estimate from). match_clip: the quantized baselines use oscar's clip ratios (default: the
    config's, 1.0 unless set), so the comparison isolates the rotation from the clipping. per_head:
    calibrated oscar fits one rotation per KV head (rotation file v2) instead of one per layer.
    model/tokenizer: an already loaded model (then model_name_or_path only names it).
    """
    started = time.perf_counter()
    config = config or OscarConfig()
    methods = list(methods)
    contexts = _check_arguments(methods, config, metrics, contexts, needle_context, chunk=chunk, ppl_tokens=ppl_tokens,
                                attn_tokens=attn_tokens, decode_tokens=decode_tokens, needle_tokens=needle_tokens,
                                needle_seeds=needle_seeds, calibration_tokens=calibration_tokens,
                                calibration_heldout=calibration_heldout)
    first = prefill if prefill is not None else max(config.sink + config.recent, chunk)
    _check_positive("prefill", first)

    if model is None:
        from ..models import load_model

        model, tokenizer = load_model(model_name_or_path)
    elif tokenizer is None:
        raise OscarInputError("tokenizer: expected one with the given model")
    shape = attention_shape(model)
    layers, kv_heads, head_dim, q_heads = shape
    config.check_head_dim(head_dim)
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest_default = min(max_pos or 2048, DEFAULT_LONGEST_CONTEXT)
    contexts = contexts or [longest_default // 4, longest_default // 2, longest_default]
    needle_context = needle_context or longest_default // 2
    needle_length = needle_context + 2 * len(needle_depths) * needle_tokens
    longest = max([*(contexts if "perplexity" in metrics else []),
                   *([needle_length] if "needle" in metrics else []),
                   *([attn_tokens] if "attention" in metrics else [])], default=0)
    if max_pos and longest > max_pos:
        raise OscarInputError(
            f"contexts/needle sequence/attn_tokens need {longest} positions: expected at most the model's "
            f"max_position_embeddings={max_pos} (a needle sequence is needle_context + 2 * needle_tokens * depths)"
        )

    if text is None:
        from ..models import BUNDLED_MODEL_DIR

        text = BUNDLED_MODEL_DIR / "heldout.txt"
    text = Path(text)
    reserve = calibration_tokens + calibration_heldout + SPLIT_MARGIN
    calibration_text, ids = text_tokens(tokenizer, text, reserve)

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    specs = build_methods(model, tokenizer, methods, config, rotations, calibration_text,
                          calibration_tokens, calibration_heldout, match_clip, per_head)
    timings["methods_and_calibration"] = time.perf_counter() - t0
    note(f"eval: methods ready in {timings['methods_and_calibration']:.0f} s")
    results = {m.name: _empty_result(m) for m in specs}

    windows, needle_control = [], None
    if "perplexity" in metrics:
        t0 = time.perf_counter()
        windows = _perplexity(model, specs, results, ids, contexts, ppl_tokens, chunk, first, text)
        timings["perplexity"] = time.perf_counter() - t0
    if "attention" in metrics:
        t0 = time.perf_counter()
        _attention(model, specs, results, ids, attn_tokens, decode_tokens)
        timings["attention"] = time.perf_counter() - t0
    if "needle" in metrics:
        t0 = time.perf_counter()
        cases = needle_cases(ids, needle_context, needle_tokens, needle_prefix, needle_depths, needle_seeds)
        _needle(model, specs, results, cases, needle_depths, needle_context, needle_length, chunk, first)
        control = [needle_accuracy(model, case, Fp16Cache(layers, kv_heads, head_dim, needle_length), chunk, first)
                   for case in needle_cases(ids, needle_context, needle_tokens, needle_prefix, needle_depths,
                                            needle_seeds, control=True)]
        needle_control = sum(sum(a.values()) / len(a) for a in control) / len(control)
        note(f"eval: needle control (fp16, no needle in the haystack) {needle_control:.3f}")
        timings["needle"] = time.perf_counter() - t0

    for m in specs:
        by_ctx = results[m.name]["bits_per_element_by_context"]
        if by_ctx:
            results[m.name]["bits_per_element"] = by_ctx[max(by_ctx, key=int)]
    timings["total"] = time.perf_counter() - started
    note(f"eval: done in {timings['total']:.0f} s")
    return {
        "model": str(model_name_or_path),
        "bits": config.k_bits if config.k_bits == config.v_bits and not config.mixed else config.describe(),
        "config": config.to_dict(),
        "shape": {"layers": layers, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim},
        "text": str(text),
        "split": {
            "calibration_tokens": reserve,
            "evaluation_tokens": int(ids.shape[0]),
            "rule": f"the first {reserve} tokens of the text are reserved for calibration; metrics read the rest",
        },
        "settings": {
            "metrics": list(metrics),
            "contexts": contexts,
            "perplexity_windows": len(windows),
            "perplexity_window_tokens": contexts[-1] if windows else None,
            "chunk": chunk,
            "prefill": first,
            "attn_tokens": attn_tokens,
            "decode_tokens": decode_tokens,
            "needle_context": needle_context,
            "needle_sequence_tokens": needle_length,
            "needle_tokens": needle_tokens,
            "needle_prefix": needle_prefix,
            "needle_depths": sorted(needle_depths),
            "needle_seeds": needle_seeds,
            "match_clip": match_clip,
        },
        "methods": results,
        # fp16 accuracy on the needles' tokens when the haystack does not contain them: what is not retrieval
        "needle_control_accuracy": needle_control,
        "runtime_s": timings,
    }


def _check_arguments(methods: list[str], config: OscarConfig, metrics, contexts, needle_context,
                     **counts) -> list[int] | None:
    """Every argument checked before the model loads; returns the sorted distinct contexts (None: the defaults)."""
    if not methods or len(set(methods)) != len(methods):
        raise OscarInputError(f"methods={methods}: expected distinct method specs")
    for spec in methods:
        method_config(spec, config)
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise OscarInputError(f"metrics={list(metrics)}: expected a subset of {list(METRICS)}")
    for name, value in counts.items():
        _check_positive(name, value)
    if contexts is not None:
        contexts = sorted(set(contexts))
        if "perplexity" in metrics and not contexts:
            raise OscarInputError("contexts: expected at least one context length")
        for c in contexts:
            _check_positive("contexts", c)
    if needle_context is not None:
        _check_positive("needle_context", needle_context)
    return contexts


def _empty_result(method) -> dict:
    return {
        "rotation": method.rotation,
        "config": method.config.to_dict() if method.config else None,
        "notes": method.notes,
        "perplexity": None,
        "perplexity_by_context": {},
        "attention_error": None,
        "attention_error_by_layer": [],
        "bits_per_element": None,
        "bits_per_element_by_context": {},
        "needle_accuracy": None,
        "needle_by_depth": {},
    }


def _perplexity(model, specs, results: dict, ids: torch.Tensor, contexts: list[int], ppl_tokens: int, chunk: int,
                first: int, text: Path) -> list[torch.Tensor]:
    """Each method's perplexity at every context over whole windows of the longest; returns the windows."""
    longest_context = contexts[-1]
    count = min(max(1, ppl_tokens // longest_context), ids.shape[0] // longest_context)
    if count == 0:
        raise OscarInputError(
            f"contexts: {longest_context} tokens but the evaluation part of {str(text)!r} has {ids.shape[0]}: "
            f"expected a context length that fits"
        )
    windows = [ids[i * longest_context : (i + 1) * longest_context] for i in range(count)]
    for m in specs:
        t1 = time.perf_counter()
        nll = torch.zeros(longest_context - 1)
        for w in windows:
            nll += token_nll(model, w, m.make(longest_context), chunk, first)
        r = results[m.name]
        # A causal model's first c tokens of a window are a window of c tokens.
        r["perplexity_by_context"] = {str(c): math.exp(float(nll[: c - 1].sum()) / (count * (c - 1)))
                                      for c in contexts}
        r["perplexity"] = sum(r["perplexity_by_context"].values()) / len(contexts)
        r["bits_per_element_by_context"] = {str(c): bits_at(m.make(1), c) for c in contexts}
        note(f"eval: {m.name} perplexity " + ", ".join(f"{c}: {r['perplexity_by_context'][str(c)]:.3f}"
                                                    for c in contexts)
             + f" ({count} window(s), {time.perf_counter() - t1:.0f} s)")
    return windows


def _attention(model, specs, results: dict, ids: torch.Tensor, attn_tokens: int, decode_tokens: int) -> None:
    if ids.shape[0] < attn_tokens:
        raise OscarInputError(f"attn_tokens={attn_tokens}: the evaluation text has only {ids.shape[0]} tokens")
    qkv = collect_qkv(model, ids[None, :attn_tokens])
    for m in specs:
        errors = attention_errors(qkv, m.make, decode_tokens)
        results[m.name]["attention_error_by_layer"] = errors
        results[m.name]["attention_error"] = sum(errors) / len(errors)
        results[m.name]["bits_per_element_by_context"].setdefault(str(attn_tokens), bits_at(m.make(1), attn_tokens))
        note(f"eval: {m.name} attention error {results[m.name]['attention_error']:.4f}")


def _needle(model, specs, results: dict, cases, depths: Sequence[float], needle_context: int, needle_length: int,
            chunk: int, first: int) -> None:
    for m in specs:
        t1 = time.perf_counter()
        acc = [needle_accuracy(model, case, m.make(needle_length), chunk, first) for case in cases]
        by_depth = {str(d): sum(a[d] for a in acc) / len(acc) for d in sorted(depths)}
        results[m.name]["needle_by_depth"] = by_depth
        results[m.name]["needle_accuracy"] = sum(by_depth.values()) / len(by_depth)
        results[m.name]["bits_per_element_by_context"].setdefault(str(needle_length),
                                                                  bits_at(m.make(1), needle_length))
        note(f"eval: {m.name} needle at {needle_context}: {results[m.name]['needle_accuracy']:.3f} "
             f"({len(cases)} sequence(s) of {needle_length} tokens, {time.perf_counter() - t1:.0f} s)")
