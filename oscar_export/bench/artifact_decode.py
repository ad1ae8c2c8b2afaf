"""`bench decode --artifact DIR`: decode tokens/s of an artifact as shipped, beside llama.cpp on the same
model's GGUF (`--gguf`, when llama-cpp-python is installed: the `bench` extra).

Every contestant prefills the same prompt (the bundled public-domain text in the artifact's tokenizer)
for real, then decodes greedily in turns of `steps` tokens, `repeats` turns each, so a noisy machine
slows all alike; the median turn gives tokens/s. The prompt leaves room for a warm-up turn and the
timed ones, so the last timed step ends at the context. The artifact runs on its target's runtime
(laptop: ONNX Runtime with the native op; android: ExecuTorch); llama.cpp runs with f16, q8_0 and q4_0
K/V caches (flash attention for the quantized ones, which llama.cpp requires).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path

import numpy as np

from ..config import OscarInputError
from ..report import read_tokens

LLAMACPP_CACHES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids
LLAMACPP_MISSING = ("llama-cpp-python is not installed (pip install 'oscar-export[bench]'; build it from source for "
                    "this CPU, e.g. CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON\")")


class LlamaCpp:
    """A GGUF model in llama.cpp with one K/V cache type, stepped like an artifact's runner (GreedyLM):
    step(ids) and prefill(ids) -> the last position's logits."""

    def __init__(self, gguf: Path, context: int, threads: int, cache: str):
        import llama_cpp

        self.lib = llama_cpp
        quantized = cache != "f16"
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, type_k=LLAMACPP_CACHES[cache], type_v=LLAMACPP_CACHES[cache],
                                   flash_attn=quantized, verbose=False)

    def step(self, ids) -> np.ndarray:
        self.llm.eval(list(ids))  # batches of n_batch itself
        # the last evaluated token's logits (Llama.scores holds them only with logits_all)
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.llm.ctx), shape=(self.llm.n_vocab(),))

    prefill = step


def bench_artifact_decode(directory, contexts=None, steps: int = 32, threads: int | None = None, repeats: int = 3,
                          gguf=None, runtime: str | None = None, profile: bool = False) -> dict:
    """Prefill and decode tokens/s of the artifact and, with `gguf`, of llama.cpp, per context (default: a
    quarter of the artifact's context and all of it). profile: then a separate profiled run of the artifact
    per context says where its decode step goes (target.decode_profile)."""
    from ..export.artifact import artifact_tokenizer
    from ..run import check_runtime, open_artifact

    directory, manifest, target = open_artifact(directory)
    runtime = check_runtime(target, runtime)
    threads = threads or os.cpu_count()
    if gguf is not None:
        gguf = Path(gguf)
        if not gguf.is_file():
            raise OscarInputError(f"--gguf {str(gguf)!r} is not a file: expected the model's GGUF")
        if importlib.util.find_spec("llama_cpp") is None:
            raise OscarInputError(f"--gguf: {LLAMACPP_MISSING}")
    tokenizer = artifact_tokenizer(directory)
    top = manifest["max_context"]
    contexts = list(contexts or (top // 4, top))
    for context in contexts:
        if context > top:
            raise OscarInputError(f"--context {context}: the artifact holds at most {top} tokens "
                                  "(its export's --context)")
        if context <= (repeats + 1) * steps + 1:
            raise OscarInputError(f"--context {context}: expected more than (repeats + 1) x steps = "
                                  f"{(repeats + 1) * steps} tokens, so a prompt is left")
    name = f"oscar ({runtime})"
    results = []
    for context in contexts:
        ids = read_tokens(tokenizer, None, context - (repeats + 1) * steps)[0].tolist()  # the bundled text
        makers = {name: lambda: target.runner(directory, manifest, runtime, threads)}
        if gguf is not None:
            makers.update({f"llama.cpp {c}": (lambda c=c: LlamaCpp(gguf, context, threads, c))
                           for c in LLAMACPP_CACHES})
        row = {"context": context, "prompt_tokens": len(ids), "prefill_tokens_per_s": {}}
        decoders, tokens = {}, {}
        for label, make in makers.items():  # one at a time: prefill uses every thread
            decoders[label] = make()
            start = time.perf_counter()
            tokens[label] = int(np.argmax(decoders[label].prefill(ids)))
            row["prefill_tokens_per_s"][label] = round(len(ids) / (time.perf_counter() - start), 1)
        rates = {label: [] for label in decoders}
        for turn in range(repeats + 1):  # turn 0 warms up
            for label, decoder in decoders.items():
                start = time.perf_counter()
                for _ in range(steps):
                    tokens[label] = int(np.argmax(decoder.step([tokens[label]])))
                if turn:
                    rates[label].append(steps / (time.perf_counter() - start))
        decoders = decoder = None  # this context's sessions and caches, freed before the next, larger one
        row["decode_tokens_per_s"] = {label: round(statistics.median(r), 2) for label, r in rates.items()}
        row["decode_turns"] = {label: [round(x, 2) for x in r] for label, r in rates.items()}
        if profile:
            row["profile"] = target.decode_profile(directory, manifest, runtime, ids, steps, threads) or \
                f"no profiler is wired for the {target.name} target's {runtime} runtime"
        results.append(row)
    return {"artifact": str(directory), "target": target.name, "runtime": runtime, "weights": manifest["weights"],
            "gguf": str(gguf) if gguf else None, "threads": threads, "steps": steps, "repeats": repeats,
            "oscar": name, "results": results,
            "method": f"prompt of context - {repeats + 1} x {steps} tokens of the bundled text, prefilled for real; "
                      f"then turns of {steps} greedy steps, one warm-up turn and {repeats} timed, contestants "
                      "alternating; median turn"}


def print_artifact_decode(report: dict) -> None:
    print(f"greedy decode of {report['artifact']} ({report['target']}, {report['runtime']}; weights "
          f"{report['weights']}), {report['threads']} threads, median of {report['repeats']} turns of "
          f"{report['steps']} steps" + (f"; llama.cpp: {report['gguf']}" if report["gguf"] else ""))
    labels = list(report["results"][0]["decode_tokens_per_s"])
    oscar = report["oscar"]
    print(f"  {'context':>7}  " + "  ".join(f"{label:>24}" for label in labels))
    for r in report["results"]:
        rate = r["decode_tokens_per_s"]
        cells = [f"{rate[label]:>10.1f} tok/s" + (f" ({rate[oscar] / rate[label]:.2f}x)" if label != oscar else "")
                 for label in labels]
        print(f"  {r['context']:>7}  " + "  ".join(f"{c:>24}" for c in cells))
    print(f"  (Nx: {oscar} tokens/s over that contestant's)")
    for r in report["results"]:
        profile = r.get("profile")
        if isinstance(profile, str):
            print(f"  profile: {profile}")
        elif profile:
            wall = profile["step_wall_ms"]
            print(f"  {oscar} at {r['context']}: {wall:.2f} ms per decode step with the profiler on "
                  f"({profile['steps']} steps)")
            parts = {f"{op} ({p['nodes_per_step']} nodes)": p["ms"] for op, p in profile["ops"].items()}
            for label, ms in {**parts, **profile["other_ms"]}.items():
                print(f"    {label:<40} {ms:>8.3f} ms  {100 * ms / wall:>5.1f}%")
