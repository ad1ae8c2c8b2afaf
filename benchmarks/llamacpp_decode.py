"""Decode tokens/s of a laptop artifact against llama.cpp on the same model's GGUF, same prompt, same threads.

    python benchmarks/llamacpp_decode.py --gguf SMOL.gguf --artifact smollm2-laptop --contexts 2048,8192

The artifact runs as shipped (ONNX Runtime, the native op, its 4-bit weights); llama.cpp (llama-cpp-python,
optional: build it from source, e.g. CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON" pip install llama-cpp-python==0.3.36 diskcache) runs the GGUF with f16, q8_0 and q4_0 K/V caches (flash
attention for the quantized ones, which llama.cpp requires). Each run prefills the same prompt (the
bundled public-domain text, `context - steps` tokens), then decodes `steps` greedy tokens; the decode
steps are timed. Runs alternate, repeated --repeats times, median reported, one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oscar_export.report import DEFAULT_TEXT  # noqa: E402

CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids


def prompt_ids(tokenizer, tokens: int) -> list[int]:
    ids = tokenizer(DEFAULT_TEXT.read_text(encoding="utf-8"), verbose=False)["input_ids"]
    if len(ids) < tokens:
        sys.exit(f"the bundled text has {len(ids)} tokens: expected at least {tokens}")
    return ids[:tokens]


def ort_decode(artifact: Path, ids: list[int], steps: int, threads: int) -> float:
    from oscar_export.export.artifact import load_manifest
    from oscar_export.targets.laptop.ort_runner import OrtLM

    manifest = load_manifest(artifact)
    lm = OrtLM(artifact, "onnxruntime", threads, manifest["max_chunk"])
    logits = lm.prefill(ids)
    start = time.perf_counter()
    for _ in range(steps):
        logits = lm.step([int(np.argmax(logits))])
    return steps / (time.perf_counter() - start)


def llamacpp_decode(gguf: Path, ids: list[int], steps: int, threads: int, cache: str, context: int) -> float:
    import llama_cpp

    quantized = cache != "f16"
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, type_k=CACHE_TYPES[cache], type_v=CACHE_TYPES[cache], flash_attn=quantized,
                          verbose=False)

    def last_logits():  # the last evaluated token's logits (Llama.scores holds them only with logits_all)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))

    llm.eval(ids)
    start = time.perf_counter()
    for _ in range(steps):
        llm.eval([int(np.argmax(last_logits()))])
    rate = steps / (time.perf_counter() - start)
    llm.close()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--artifact", type=Path, required=True, help="a laptop artifact of the same model")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, help="JSON file for the results")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.artifact, local_files_only=True)
    try:
        import llama_cpp  # noqa: F401
        caches = list(CACHE_TYPES)
    except ImportError:
        print("llama-cpp-python is not installed: only the artifact is measured", file=sys.stderr)
        caches = []
    results = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids = prompt_ids(tokenizer, context - args.steps)
        runs = {"oscar (onnxruntime)": [], **{f"llama.cpp {c}": [] for c in caches}}
        for _ in range(args.repeats):
            runs["oscar (onnxruntime)"].append(ort_decode(args.artifact, ids, args.steps, args.threads))
            for c in caches:
                runs[f"llama.cpp {c}"].append(llamacpp_decode(args.gguf, ids, args.steps, args.threads, c, context))
        row = {"context": context, "prompt_tokens": len(ids), "steps": args.steps, "threads": args.threads,
               **{name: statistics.median(rates) for name, rates in runs.items()}}
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
