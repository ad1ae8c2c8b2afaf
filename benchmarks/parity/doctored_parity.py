"""Can parity --artifact fail? Export an artifact whose program is wrong in one place and whose manifest still names
the genuine inputs, as a faulty export would write it, then run parity on it:

- rotation: layer --layer's K rotation replaced by the identity in the program (the artifact's rotations file, which
  the reference reads, stays the calibrated one);
- weights: every linear weight of layer --layer scaled by 1.01 before quantization (the manifest still names the
  source checkpoint, which the reference reads).

    .venv/bin/python -m benchmarks.parity.doctored_parity --target laptop --model M --context 4096 --doctor rotation \\
        --out /tmp/doctored [--parity "--kl-tokens 2048"] [--old-tree DIR --old-parity "..."] [--json FILE]

Writes the artifact to --out, then runs `oscar-export parity --artifact OUT --json` in a fresh process (no patch
there) and prints its verdicts; with --old-tree DIR it also runs the parity of another checkout (e.g. a git worktree
of an earlier commit) on the same artifact, for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from oscar_export import hf_cache, models
from oscar_export.export import streamed
from oscar_export.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def doctor_rotation(layer: int):
    resolve = hf_cache.resolve_rotations

    def doctored(rotations, model):
        resolved = resolve(rotations, model)
        if hasattr(resolved, "k"):
            resolved.k[layer] = torch.eye(resolved.head_dim, dtype=resolved.k.dtype)
        return resolved

    hf_cache.resolve_rotations = doctored


def doctor_weights(layer: int, factor: float = 1.01):
    load = models.load_model

    def doctored(name, *args, **kwargs):
        model, tokenizer = load(name, *args, **kwargs)
        with torch.no_grad():
            for module in model.model.layers[layer].modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.mul_(factor)
        return model, tokenizer

    models.load_model = doctored
    streamed.is_streamable = lambda checkpoint: False  # a streamed export would read the checkpoint's own tensors


def parity(artifact: Path, extra: list[str], tree: Path | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree)) if tree else None
    proc = subprocess.run([sys.executable, "-m", "oscar_export", "parity", "--artifact", str(artifact), "--json",
                           *extra], capture_output=True, text=True, env=env, cwd=tree or ROOT)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"parity exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def verdicts(report: dict) -> dict:
    out = {"ok": report["ok"], "runtimes": {name: {"ok": r["ok"], "tokens_match": r["tokens_match"],
                                                   "near_tie": r["near_tie"], "tie_margin": r["tie_margin"],
                                                   "logits_max_rel_error": r["logits_max_rel_error"],
                                                   "codes_mismatch_fraction": r["codes_mismatch_fraction"]}
                                            for name, r in report["runtimes"].items()}}
    if report.get("weight_gains"):
        out["weight_gains"] = report["weight_gains"]
    if report.get("distribution"):
        d = report["distribution"]
        out["distribution"] = {"weight_format": d["weight_format"], "limits": d["limits"], "runtimes": d["runtimes"]}
    if report.get("answers"):
        out["answers"] = {q["question"]: {n: (a["answer"], a["ok"]) for n, a in q["answers"].items()}
                          for q in report["answers"]["questions"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--doctor", choices=("rotation", "weights"), required=True)
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--export-flags", default="", help="more export flags, space-separated")
    parser.add_argument("--parity", default="", help="more parity flags, space-separated")
    parser.add_argument("--old-tree", type=Path, help="a checkout whose parity also judges the artifact")
    parser.add_argument("--old-parity", default="", help="that checkout's parity flags, space-separated")
    parser.add_argument("--json", type=Path, help="write the verdicts here")
    args = parser.parse_args()
    (doctor_rotation if args.doctor == "rotation" else doctor_weights)(args.layer)
    code = cli_main(["--target", args.target, "--model", args.model, "--context", str(args.context), "--out",
                     str(args.out), *args.export_flags.split()])
    if code:
        raise SystemExit(f"export exited {code}")
    result = {"command": ".venv/bin/python -m benchmarks.parity.doctored_parity " + " ".join(sys.argv[1:]), "doctor": args.doctor,
              "layer": args.layer, "parity": verdicts(parity(args.out, args.parity.split(), None))}
    if args.old_tree:
        result["old_parity"] = verdicts(parity(args.out, args.old_parity.split(), args.old_tree))
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
