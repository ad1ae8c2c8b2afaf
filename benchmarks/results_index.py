"""Writes benchmarks/results/README.md: every result file with what it measured, the machine, the date and commit it
was added at (or the commit it records) and the command that makes it. Run after adding results."""

import json
import re
import subprocess
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / 'benchmarks/results'
files = sorted(p.relative_to(RES).as_posix() for p in RES.rglob('*') if p.is_file() and p != RES / 'README.md')
AMD = "2-core AMD EPYC (x86-64, shared host)"
XEON = "2-core Intel Xeon (x86-64, shared host)"
groups = [
 ("Parity", r"^(parity_|activation_rounding)", "parity --artifact rows, doctored artifacts, activation rounding (docs/parity.md)", AMD,
  "`oscar-export parity --artifact A [--kl-tokens N] --json`; `python benchmarks/activation_rounding.py`; `python benchmarks/doctored_parity.py` (the files' headers say which)"),
 ("Attention kernels", r"(^|/)(android|laptop)_attention\.json$|decode_floor|kernel_sets|scale_dtype_speed|neon_instructions", "decode-attention latency of the OSCAR op against each runtime's own attention, bytes read and share of copy bandwidth; the core's floor; kernel sets; scale dtypes; NEON instruction counts (docs/kernels.md)", None,
  "`nice -n 10 .venv/bin/python benchmarks/attention_tables.py`, `benchmarks/decode_floor.py`, `benchmarks/kernel_sets.py`, `benchmarks/scale_dtype_speed.py`, `bash benchmarks/neon_instructions.sh`"),
 ("Decode", r"_decode|llamacpp_", "whole-model decode tokens/s against the runtime's own caches and llama.cpp (docs/laptop.md, docs/android.md)", None,
  "`oscar-export bench decode [--artifact A --gguf G]`; `python benchmarks/android_decode.py`"),
 ("Llama-3-8B shape", r"^llama8b/", "export peak memory by depth and run-time memory at 4K-32K of a seeded Llama-3-8B-shape checkpoint (llama8b/README.md)", "2-core AMD EPYC, 23 GiB RAM, no swap",
  "`bash benchmarks/llama8b_memory.sh`"),
 ("Quality", r"^eval/", "perplexity, attention error and needle retrieval of cache formats on the bundled model and SmolLM2 (docs/calibration.md, docs/format.md)", AMD,
  "`bash benchmarks/smollm2_eval.sh`, `python benchmarks/{smollm2_levers,subspace_clustering,mixed_key_bits,head_key_bits,feedback_rounding,scale_storage,value_feedback}.py --split validation|test`, `oscar-export eval` (bundled: eval*, match*)"),
 ("GPU", r"^gpu/", "Triton kernels on an H200: exactness, decode timing against bf16 SDPA, the Triton tests, parity against a CUDA trace (gpu/README.md)", "NVIDIA H200",
  "`bash benchmarks/gpu_checks.sh`"),
 ("Robustness", r"^fuzz_", "the fuzz harness's families, before and after a round of fixes (docs/robustness.md)", AMD,
  "`.venv/bin/python tests/fuzz_inputs.py --cases 60 --native-cases 16 --seed 2 [--artifact A]`"),
 ("SmolLM2 through every target", r"^smollm2_targets", "export time, bytes against the planner, a chat answer, decode speed and parity of SmolLM2 on every target", AMD,
  "`bash benchmarks/smollm2_targets.sh`"),
]
# Files whose command no longer runs as recorded.
NOTES = {"parity_noise_smollm2_laptop.json": "the noise floor's measurement (`benchmarks/parity_noise.py`, removed with "
         "`--noise-runs`: docs/parity.md says why); kept as the record of what the old limits were"}


def meta(f):
    p = RES / f
    out = {}
    if p.suffix == '.json':
        try:
            d = json.loads(p.read_text())
        except Exception:
            d = None
        if isinstance(d, dict):
            out = {k: d.get(k) for k in ('machine', 'command', 'commit') if isinstance(d.get(k), str)}
    log = subprocess.run(['git', 'log', '-1', '--format=%h %ad', '--date=short', '--', f'benchmarks/results/{f}'], cwd=ROOT, capture_output=True, text=True).stdout.split()
    out.setdefault('commit', log[0] if log else '')
    out['date'] = log[1] if len(log) > 1 else ''
    return out
def machine_default(f):
    if f.startswith('intel_xeon/'): return XEON
    return AMD
lines = ["# Benchmark results", "",
 "What each file under `benchmarks/results/` measured, on which machine, when (the commit that added the file, or the",
 "commit the file itself records), and the command that makes it. Every file here is listed (tests/test_results_index.py",
 "checks); ratios are measured side by side in one run, so compare rows of one file, not files of different machines.", ""]
seen = set()
for name, pattern, what, machine, command in groups:
    members = [f for f in files if re.search(pattern, f) and f not in seen]
    seen.update(members)
    lines += [f"## {name}", "", f"{what}. Made by {command}.", "", "| file | machine | date | commit | command |", "|---|---|---|---|---|"]
    for f in members:
        m = meta(f)
        cmd = m.get('command', '').replace('|', '\\|')
        mach = (m.get('machine') or machine or machine_default(f)).replace('|', '/')
        note = NOTES.get(f, ('`' + cmd + '`') if cmd else "the section's")
        lines.append(f"| `{f}` | {mach} | {m['date']} | {m['commit']} | {note} |")
    lines.append("")
left = [f for f in files if f not in seen]
assert not left, left
(RES / 'README.md').write_text('\n'.join(lines))
print(len(files), 'files indexed')
