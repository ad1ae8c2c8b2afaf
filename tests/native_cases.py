"""Cases for the native OscarAttention op (tests/runtime_ops/test_native_core.py, tests/runtime_ops/test_ort_ops.py).

The op works in rotated space on one layer: q fp32 and k/v fp16 already rotated, outputs before
the R_v^T that the model folds into its output projection. A Case holds one sequence in those
terms: its chunks (a prefill then decode steps, or random sizes), the reference outputs and the
reference cache after the last chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from oscar_export import OscarConfig
from oscar_export.cache import OscarKVCache
from oscar_export.sizes import capacities

VECTORS = Path(__file__).parent / "vectors"
INDEX = json.loads((VECTORS / "index.json").read_text())
# The op (the native core, its ONNX Runtime and ExecuTorch adapters, the torch op, the Core ML and pure-ONNX
# lowerings) stores fp16 or fp8 (E4M3) scales: OP_GOLDEN; GOLDEN is the fp16 ones. bf16 and fp32 scales stay
# with the reference and the Triton kernels.
GOLDEN = sorted(name for name, meta in INDEX["cases"].items() if meta["config"]["scale_dtype"] == "float16")
OP_GOLDEN = sorted(name for name, meta in INDEX["cases"].items()
                     if meta["config"]["scale_dtype"] in ("float16", "float8_e4m3fn"))
# The native core's scale_dtype numbers (runtime_ops/core/oscar_c_api.h) and element types.
SCALE_DTYPES = {"float16": (0, np.float16), "float8_e4m3fn": (1, np.uint8)}
KINDS = ("k", "v")
REGIONS = ("sink", "recent", "codes", "scale", "zero")
# Cache buffers in the op's input order (after q, k_new, v_new).
CACHE_INPUTS = ("k_sink", "v_sink", "k_recent", "v_recent", "k_codes", "k_scale", "k_zero",
                "v_codes", "v_scale", "v_zero", "k_levels", "v_levels", "k_feedback")


@dataclass
class Case:
    name: str
    config: OscarConfig
    q_heads: int
    kv_heads: int
    head_dim: int
    max_context: int
    levels: dict[str, np.ndarray]  # fp32 [2**bits] per kind, uniform included
    chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # rotated q fp32, k fp16, v fp16
    outputs: list[np.ndarray]  # fp32 [q_heads, T, head_dim], rotated (V) space
    final: dict[str, np.ndarray]  # "k_sink" ... "v_zero" as in the op, after the last chunk
    feedback: np.ndarray | None = None  # K's error-feedback weights [kv_heads, D, D] (k_rounding 'feedback')

    @property
    def scaling(self) -> float:
        return float(np.float32(self.head_dim**-0.5))

    def empty_cache(self) -> dict[str, np.ndarray]:
        """Zeroed cache buffers in the op's layout, levels and feedback weights (empty: nearest) filled in."""
        s, w, b = capacities(self.config, self.max_context)
        h, d, g = self.kv_heads, self.head_dim, self.head_dim // self.config.cluster_dim
        out = {}
        for kind in KINDS:
            out[f"{kind}_sink"] = np.zeros((h, s, d), np.float16)
            out[f"{kind}_recent"] = np.zeros((h, w, d), np.float16)
            out[f"{kind}_codes"] = np.zeros((h, b, d * self.config.bits(kind) // 8), np.uint8)
            out[f"{kind}_scale"] = np.zeros((h, b, g), SCALE_DTYPES[self.config.scale_dtype][1])
            out[f"{kind}_zero"] = np.zeros((h, b, g), SCALE_DTYPES[self.config.scale_dtype][1])
            out[f"{kind}_levels"] = self.levels[kind].copy()
        out["k_feedback"] = np.zeros(0, np.float32) if self.feedback is None else self.feedback.copy()
        return {name: out[name] for name in CACHE_INPUTS}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|: the format's relative error of one attention output."""
    return float(np.abs(got.astype(np.float64) - want).max() / max(float(np.abs(want).max()), 1e-30))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.kind == "f":
        a, b = a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")
    return a.shape == b.shape and bool((a == b).all())


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy; fp8 (E4M3) as its uint8 bits, the layout the native core stores."""
    return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy()


def _final(cache: OscarKVCache) -> dict[str, np.ndarray]:
    return {f"{kind}_{region}": as_numpy(getattr(cache, region)[kind][0]).copy() for kind in KINDS for region in REGIONS}


def _levels(cache: OscarKVCache, config: OscarConfig) -> dict[str, np.ndarray]:
    return {kind: (np.arange(2 ** config.bits(kind), dtype=np.float32) if cache.levels[kind][0] is None
                   else cache.levels[kind][0].numpy().astype(np.float32)) for kind in KINDS}


def golden_case(name: str) -> Case:
    """A golden vector case: prefill then decode steps, on the stored rotated inputs the kernel consumes."""
    meta = INDEX["cases"][name]
    cfg = OscarConfig.from_dict(meta["config"])
    t = load_file(str(VECTORS / meta["file"]))
    bounds = [(0, meta["prefill"])] + [(i, i + 1) for i in range(meta["prefill"], meta["tokens"])]
    chunks = [tuple(t[f"cache.{x}_rot"][:, a:b].numpy() for x in "qkv") for a, b in bounds]
    outputs = [t["cache.prefill_out_rot"].numpy()] + [row.unsqueeze(1).numpy() for row in t["cache.decode_out_rot"]]
    levels = {kind: (t[f"cache.{kind}_levels"][0].numpy() if cfg.codebook == "lloyd-max"
                     else np.arange(2 ** cfg.bits(kind), dtype=np.float32)) for kind in KINDS}
    final = {f"{kind}_{region}": as_numpy(t[f"cache.final.{kind}.{region}"][0]) for kind in KINDS for region in REGIONS}
    feedback = t["cache.k_feedback"][0].numpy() if cfg.k_rounding == "feedback" else None
    return Case(name, cfg, meta["q_heads"], meta["kv_heads"], meta["head_dim"], meta["tokens"],
                levels, chunks, outputs, final, feedback)


def _random_levels(rng: np.random.Generator, bits: int) -> torch.Tensor:
    n = 2**bits
    while True:  # ascending inside [0, n - 1], like fitted Lloyd-Max levels
        levels = np.sort(rng.uniform(0, n - 1, n)).astype(np.float32)
        if (np.diff(levels) > 1e-3).all():
            return torch.from_numpy(levels)


def random_case(rng: np.random.Generator, index: int, max_context: int = 40, max_chunk: int = 12,
                scale_dtypes: tuple[str, ...] = ("float16",)) -> Case:
    """A small random sequence (identity rotation) run through the reference OscarKVCache, its scales and zeros
    in one of scale_dtypes."""
    cluster_dim = int(rng.choice([32, 64, 128]))
    head_dim = cluster_dim * int(rng.choice([1, 2])) if cluster_dim < 128 else 128
    cfg = OscarConfig(
        k_bits=int(rng.choice([2, 3, 4])), v_bits=int(rng.choice([2, 3, 4])), cluster_dim=cluster_dim,
        k_clip=float(rng.choice([1.0, 1.0, 0.96, 0.8, 0.5])), v_clip=float(rng.choice([1.0, 1.0, 0.92, 0.7])),
        codebook=str(rng.choice(["uniform", "uniform", "lloyd-max"])),
        sink=int(rng.choice([0, 1, 2, 5])), recent=int(rng.choice([0, 1, 3, 8])),
    )
    if cfg.codebook == "uniform" and rng.random() < 0.3:
        cfg = replace(cfg, k_rounding="feedback")
    if len(scale_dtypes) > 1:
        cfg = replace(cfg, scale_dtype=str(rng.choice(scale_dtypes)))
    kv_heads = int(rng.choice([1, 2]))
    q_heads = kv_heads * int(rng.choice([1, 2, 3, 4]))
    max_context = int(rng.integers(1, max_context + 1))
    tokens = int(rng.integers(1, max_context + 1))
    levels = {kind: None if cfg.codebook == "uniform" else [_random_levels(rng, cfg.bits(kind))] for kind in KINDS}
    feedback = None
    if cfg.k_rounding == "feedback":  # weights of calibration's size: strictly upper, about 1
        feedback = np.triu(rng.standard_normal((kv_heads, head_dim, head_dim), dtype=np.float32) * 0.3, 1)
    cache = OscarKVCache(cfg, 1, kv_heads, head_dim, max_context, k_levels=levels["k"], v_levels=levels["v"],
                         k_feedback=None if feedback is None else torch.from_numpy(feedback)[None])
    # Up to fp16's range, or well inside fp8's (E4M3 stores no scale or |zero| above 448).
    scale = float(rng.choice([1.0, 10.0, 300.0 if cfg.scale_dtype == "float16" else 40.0]))
    q = torch.from_numpy(rng.standard_normal((q_heads, tokens, head_dim), dtype=np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((kv_heads, tokens, head_dim), dtype=np.float32) * scale)
            for _ in KINDS)
    if rng.random() < 0.2:  # a constant vector: scale 0, codes 0
        k[:, int(rng.integers(tokens))] = 1.5
    chunks, outputs, start = [], [], 0
    while start < tokens:
        t = 1 if rng.random() < 0.5 else int(rng.integers(2, max_chunk))
        end = min(tokens, start + t)
        outputs.append(cache.attend(0, q[:, start:end], k[:, start:end], v[:, start:end]).numpy())
        chunks.append((q[:, start:end].numpy(), k[:, start:end].half().numpy(), v[:, start:end].half().numpy()))
        start = end
    return Case(f"random{index}", cfg, q_heads, kv_heads, head_dim, max_context, _levels(cache, cfg),
                chunks, outputs, _final(cache), feedback)


def export_for_core_test(case: Case, directory: Path) -> Path:
    """Write a golden case in runtime_ops/tests/core_test.cc's format: case.txt + raw .bin files."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = INDEX["cases"][case.name]
    cfg = case.config
    t = load_file(str(VECTORS / meta["file"]))
    fields = {
        "name": case.name, "k_bits": cfg.k_bits, "v_bits": cfg.v_bits, "cluster_dim": cfg.cluster_dim,
        "sink": cfg.sink, "recent": cfg.recent, "k_clip": float(np.float32(cfg.k_clip)).hex(),
        "v_clip": float(np.float32(cfg.v_clip)).hex(), "scaling": case.scaling.hex(),
        "q_heads": case.q_heads, "kv_heads": case.kv_heads, "head_dim": case.head_dim,
        "tokens": meta["tokens"], "prefill": meta["prefill"],
        "codec_bits": meta["codec_bits"], "codec_clip": float(np.float32(meta["codec_clip"])).hex(),
        "k_rounding": int(case.feedback is not None), "scale_dtype": SCALE_DTYPES[cfg.scale_dtype][0],
    }
    (directory / "case.txt").write_text("".join(f"{key} {value}\n" for key, value in fields.items()))
    arrays = {
        "q": np.concatenate([c[0] for c in case.chunks], axis=1),
        "k": np.concatenate([c[1] for c in case.chunks], axis=1),
        "v": np.concatenate([c[2] for c in case.chunks], axis=1),
        "k_levels": case.levels["k"], "v_levels": case.levels["v"],
        "prefill_out": case.outputs[0],
        "decode_out": np.stack([out[:, 0] for out in case.outputs[1:]]),
        "codec_input": t["codec.input"].numpy(), "codec_levels": case.levels["k"],
        "codec_codes": t["codec.codes"].numpy(), "codec_scale": as_numpy(t["codec.scale"]),
        "codec_zero": as_numpy(t["codec.zero"]),
    }
    arrays.update({f"final_{name}": value for name, value in case.final.items()})
    if case.feedback is not None:
        arrays["k_feedback"] = case.feedback
    for name, value in arrays.items():
        np.ascontiguousarray(value).tofile(directory / f"{name}.bin")
    return directory


def assert_final_cache(case: Case, cache: dict) -> None:
    for name, want in case.final.items():
        assert same_bits(cache[name], want), f"{case.name}: final {name} differs"
