"""What rounding activations to int8 on the fly costs a laptop artifact, and why its runs are so sensitive to float
noise: next-token distributions (KL divergence, top-1 agreement) of one teacher-forced pass over a real text.

    .venv/bin/python -m benchmarks.parity.activation_rounding --artifact A [--tokens 1024] [--out results.json]

A is a laptop artifact with 4-bit MatMulNBits weights and int8 activations (the default export). Every run is one
prefill of the first --tokens tokens of the bundled held-out text through the eager graph with the artifact's cache
format, all positions scored (the chunk's own tokens stay fp16 in attention, the same in every run: only the
weights and activations differ). Rows:

- the weight format split in two: float -> 4-bit weights (float activations) -> int8 activations as well;
- the int8 activations of one layer at a time (the rest float), so the layers that cost most stand out;
- the rounded run again with its attention outputs jittered by a relative 1e-6 (a few fp32 ulps), against itself:
  how far float noise moves it on the probability scale, which the old end-to-end limits measured in L2 of logits;
- per linear layer, the int8 rounding's relative error on its input, and the input's largest |x| over its RMS
  (an outlier channel takes the block's range and rounds its 31 neighbours coarsely).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

from oscar_export.parity.distribution import Distributions, compare
from oscar_export.export.artifact import eager_module
from oscar_export.export.graph import OscarDecoderLayer
from oscar_export.run import open_artifact
from oscar_export.report import read_tokens


def one_pass(module, ids: list[int], max_context: int) -> np.ndarray:
    """Logits at every position of one prefill of `ids`."""
    module.all_logits = True
    cache = module.new_cache(max_context)
    with torch.no_grad():
        logits = module(torch.tensor([ids]), torch.zeros(1, dtype=torch.int64), *cache)
    return logits[0].float().numpy()


def rounding_hooks(module) -> list[tuple[int, torch.nn.Linear, object]]:
    """(layer or -1 for the head, linear, its int8-activation hook) for every linear that rounds its input."""
    found = []
    layers = [m for m in module.modules() if isinstance(m, OscarDecoderLayer)]
    for linear in (m for m in module.modules() if isinstance(m, torch.nn.Linear)):
        for hook in linear._forward_pre_hooks.values():
            layer = next((i for i, block in enumerate(layers) if any(linear is m for m in block.modules())), -1)
            found.append((layer, linear, hook))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    directory, manifest, target = open_artifact(args.artifact)
    if not target.rounds_activations(manifest) or target.name != "laptop":
        raise SystemExit("expected a laptop artifact with int8 activations (the default export)")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = read_tokens(tokenizer, None, args.tokens + 1)[0].tolist()
    targets, ids = ids[1:], ids[:-1]
    context = max(manifest["max_context"], len(ids))

    def run(module) -> Distributions:
        return Distributions(one_pass(module, ids, context), targets)

    float_module = eager_module(directory, manifest)
    rounded = target.artifact_module(directory, manifest, copy.deepcopy(float_module))
    hooks = rounding_hooks(rounded)
    float_run, rounded_run = run(float_module), run(rounded)
    for _, linear, hook in hooks:
        linear._forward_pre_hooks.clear()
    weights_only = run(rounded)
    rows = {"float -> 4-bit weights": compare(float_run, weights_only),
            "4-bit weights -> int8 activations too": compare(weights_only, rounded_run),
            "float -> 4-bit weights and int8 activations": compare(float_run, rounded_run)}
    print(json.dumps(rows, indent=1), flush=True)

    per_layer = {}
    layers = sorted({layer for layer, _, _ in hooks})
    for layer in layers:
        for at, linear, hook in hooks:
            linear._forward_pre_hooks.clear()
            if at == layer:
                linear.register_forward_pre_hook(hook)
        per_layer["head" if layer < 0 else layer] = compare(weights_only, run(rounded))
        print(f"int8 activations in {'the head' if layer < 0 else f'layer {layer}'} alone: KL mean "
              f"{per_layer['head' if layer < 0 else layer]['kl_mean']:.2e}", flush=True)

    # Input statistics of every rounding linear, over the same pass, all hooks back on.
    inputs = []
    for _, linear, hook in hooks:
        linear._forward_pre_hooks.clear()
        linear.register_forward_pre_hook(hook)

    def observe(name):
        def record(_, args):
            x = args[0].float()
            q = hooks_by_linear[name](None, (x,))[0]
            rms = float(x.pow(2).mean().sqrt())
            inputs.append({"linear": name, "rel_error": float((q - x).norm() / x.norm()),
                           "max_over_rms": float(x.abs().max()) / max(rms, 1e-30)})
        return record

    names = {id(m): n for n, m in rounded.named_modules()}
    hooks_by_linear = {names[id(linear)]: hook for _, linear, hook in hooks}
    observers = [linear.register_forward_pre_hook(observe(names[id(linear)]), prepend=True)  # before the rounding
                 for _, linear, _ in hooks]
    run(rounded)
    for handle in observers:
        handle.remove()

    # Float noise: the attention outputs (o_proj's input, before its rounding) times 1 + 1e-6 * N(0, 1).
    noise = torch.Generator().manual_seed(0)
    projections = [m.o_proj for m in rounded.modules() if isinstance(m, OscarDecoderLayer)]
    jitters = [p.register_forward_pre_hook(
        lambda _, a: (a[0] * (1 + 1e-6 * torch.randn(a[0].shape, generator=noise)),) + a[1:], prepend=True)
        for p in projections]
    jittered = compare(rounded_run, run(rounded))
    for handle in jitters:
        handle.remove()
    print(f"rounded run against itself jittered by 1e-6: KL mean {jittered['kl_mean']:.2e}, p99.9 "
          f"{jittered['kl_p999']:.2e}, top-1 {jittered['top1_agreement']:.4f}", flush=True)

    worst = sorted(inputs, key=lambda r: -r["rel_error"])[:10]
    result = {"command": ".venv/bin/python -m benchmarks.parity.activation_rounding " + " ".join(sys.argv[1:]), "artifact": str(directory),
              "model": manifest["model"]["source"], "weights": manifest["weights"], "positions": len(targets),
              "split": rows, "int8_activations_in_one_layer": per_layer, "jitter_1e-6": jittered,
              "inputs": inputs, "worst_inputs": worst}
    for row in worst:
        print(f"  {row['linear']}: int8 rounding error {row['rel_error']:.3%}, max|x|/rms {row['max_over_rms']:.0f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
