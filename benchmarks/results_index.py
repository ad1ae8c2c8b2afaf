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
 ("Parity", r"^parity/", "parity --artifact rows, doctored artifacts, activation rounding (docs/parity.md)", AMD,
  "`oscar-export parity --artifact A [--kl-tokens N] --json`; `python -m benchmarks.parity.activation_rounding`; `python -m benchmarks.parity.doctored_parity` (the files' headers say which)"),
 ("Attention kernels", r"^kernels/(?!gpu/)", "decode-attention latency of the OSCAR op against each runtime's own attention, bytes read and share of copy bandwidth; the core's floor; kernel sets; scale dtypes; NEON instruction counts (docs/kernels.md)", None,
  "`nice -n 10 .venv/bin/python -m benchmarks.kernels.{attention_tables,decode_floor,kernel_sets,scale_dtype_speed}`, `bash benchmarks/kernels/neon_instructions.sh`"),
 ("Decode", r"^targets/(\w*_decode|llamacpp_)", "whole-model decode tokens/s against the runtime's own caches and llama.cpp (docs/laptop.md, docs/android.md)", None,
  "`oscar-export bench decode [--artifact A --gguf G]`; `python -m benchmarks.targets.android_decode`"),
 ("Llama-3-8B shape", r"^targets/llama8b/", "export peak memory by depth and run-time memory at 4K-32K of a seeded Llama-3-8B-shape checkpoint (targets/llama8b/README.md)", "2-core AMD EPYC, 23 GiB RAM, no swap",
  "`bash benchmarks/targets/llama8b_memory.sh`"),
 ("Quality", r"^quality/", "perplexity, attention error and needle retrieval of cache formats on the bundled model and SmolLM2 (docs/calibration.md, docs/format.md)", AMD,
  "`bash benchmarks/quality/smollm2_eval.sh`, `python -m benchmarks.quality.{smollm2_levers,subspace_clustering,mixed_key_bits,head_key_bits,feedback_rounding,scale_storage,value_feedback} --split validation|test`, `python -m benchmarks.quality.device_default`, `oscar-export eval` (bundled: eval*, match*)"),
 ("GPU", r"^kernels/gpu/", "Triton kernels on an H200: exactness, decode timing against bf16 SDPA, the Triton tests, parity against a CUDA trace (kernels/gpu/README.md)", "NVIDIA H200",
  "`bash benchmarks/kernels/gpu_checks.sh`"),
 ("Robustness", r"^robustness/", "the fuzz harness's families, before and after a round of fixes (docs/robustness.md)", AMD,
  "`.venv/bin/python tests/fuzz_inputs.py --cases 60 --native-cases 16 --seed 2 [--artifact A]`"),
 ("SmolLM2 through every target", r"^targets/smollm2_", "export time, bytes against the planner, a chat answer, decode speed and parity of SmolLM2 on every target; the export timed with the device-chosen format", AMD,
  "`bash benchmarks/targets/smollm2_targets.sh`; the export timing's commands are in its file"),
]
# Files whose command no longer runs as recorded.
NOTES = {"parity/parity_noise_smollm2_laptop.json": "the noise floor's measurement (`benchmarks/parity_noise.py`, removed with "
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
    commit, date = last_change(f)
    out.setdefault('commit', commit)
    out['date'] = date
    return out
def last_change(f):
    """The last commit that wrote the file's content: a move (a rename at 100% similarity) is not a measurement."""
    log = subprocess.run(['git', 'log', '--follow', '--format=@%h %ad', '--date=short', '--name-status', '--', f'benchmarks/results/{f}'],
                         cwd=ROOT, capture_output=True, text=True).stdout
    for entry in log.split('@')[1:]:
        head, *changes = [line for line in entry.splitlines() if line.strip()]
        if not all(c.startswith('R100') for c in changes):
            return tuple(head.split())
    return '', ''
def machine_default(f):
    if f.startswith('kernels/intel_xeon/'): return XEON
    return AMD
lines = ["# Benchmark results", "",
 "What each file under `benchmarks/results/` measured, on which machine, when (the commit that added the file, or the",
 "commit the file itself records), and the command that makes it. Every file here is listed (tests/test_results_index.py",
 "checks); ratios are measured side by side in one run, so compare rows of one file, not files of different machines.",
 "A command is shown as the file records it: those recorded before scripts and results were grouped by topic name",
 "flat paths (`benchmarks/NAME.py` now runs as `python -m benchmarks.TOPIC.NAME`, `benchmarks/results/X` is under its",
 "topic's folder here; benchmarks/README.md lists the topics).", ""]
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
