"""How far an artifact's reference drifts from itself as its attention outputs are jittered by a growing relative
eps: the resolution of end-to-end parity on an artifact that rounds activations (docs/parity.md, noise_floor).

    .venv/bin/python benchmarks/parity_noise.py --artifact A [--eps 1e-6,1e-3,1e-2,1e-1] [--runs 2]

Same prompt and steps as `parity --artifact` (the first --prompt-tokens of the bundled held-out text, 16 forced
steps). A jitter the drift cannot tell from 1e-6's is an attention error end-to-end parity cannot see. Prints one
line per eps; --out also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oscar_export.export.artifact import eager_trace  # noqa: E402
from oscar_export.export.pipeline import reference_module  # noqa: E402
from oscar_export.parity import noise_floor  # noqa: E402
from oscar_export.report import read_tokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--eps", default="1e-6,1e-3,1e-2,1e-1", help="comma-separated relative jitters")
    parser.add_argument("--runs", type=int, default=2, help="seeded runs per eps")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.artifact, local_files_only=True)
    ids = read_tokens(tokenizer, None, args.prompt_tokens)[0].tolist()
    module, manifest = reference_module(args.artifact)
    reference = eager_trace(module, manifest, ids, args.steps)
    rows = []
    for eps in (float(e) for e in args.eps.split(",")):
        floor = noise_floor(module, manifest, ids, args.steps, reference, args.runs, eps)
        rows.append(floor)
        runs = ", ".join(f"{r['logits_max_rel_error']:.3f} / {r['codes_mismatch_fraction']:.2e}" for r in floor["runs"])
        print(f"eps {eps:g}: logits / codes per run: {runs}", flush=True)
    result = {"command": "benchmarks/parity_noise.py " + " ".join(sys.argv[1:]), "artifact": str(args.artifact),
              "prompt_tokens": len(ids), "steps": args.steps, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
