"""End-to-end decode speed of the android .pte on this machine at a long context.

Exports the bundled model twice from the same graph: with the OSCAR cache (the default recipe:
64 sink + 256 recent fp16 tokens, the rest 2-bit) and with an uncompressed cache (every token in
the fp16 sink window, read by the same kernel), fills each to the context with held-out text, then
times greedy decode steps through the pybindings.

    .venv/bin/python -m benchmarks.targets.android_decode --context 2048 --steps 64 --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def decode_rate(directory: Path, prompt: list[int], steps: int, threads: int) -> dict:
    from oscar_export.targets.android.runner import EtLM

    lm = EtLM(directory, threads)
    logits = lm.prefill(prompt)
    start = time.perf_counter()
    for _ in range(steps):
        logits = lm.step([int(np.argmax(logits))])
    seconds = time.perf_counter() - start
    return {"tokens_per_s": round(steps / seconds, 2), "ms_per_token": round(1e3 * seconds / steps, 3),
            "filled": lm.length}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--float-weights", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from oscar_export.config import OscarConfig
    from oscar_export.export.pipeline import export_artifact
    from oscar_export.targets import get
    from oscar_export.models import BUNDLED_MODEL_DIR, load_model

    _, tokenizer = load_model("bundled")
    text = (BUNDLED_MODEL_DIR / "heldout.txt").read_text()
    ids = tokenizer(text, verbose=False)["input_ids"]
    fill = args.context - args.steps
    prompt = (ids * (fill // len(ids) + 1))[:fill]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cache in (("oscar", {}), ("fp16_cache", {"sink": args.context, "recent": 0})):
            out = Path(tmp) / name
            export_artifact(get("android"), "bundled", out, "hadamard", args.context, float_weights=args.float_weights,
                            config=OscarConfig(**cache))
            results[name] = decode_rate(out, prompt, args.steps, args.threads)
            results[name]["pte_bytes"] = (out / "model.pte").stat().st_size
    report = {"context": args.context, "steps": args.steps, "threads": args.threads,
              "weights": "float32" if args.float_weights else "int4", "results": results,
              "speedup": round(results["oscar"]["tokens_per_s"] / results["fp16_cache"]["tokens_per_s"], 3)}
    print(json.dumps(report, indent=2) if args.json else report)


if __name__ == "__main__":
    main()
