"""benchmarks/results/README.md lists every result file, and every file it lists exists."""

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_every_result_file_is_indexed_and_every_indexed_file_exists():
    index = RESULTS / "README.md"
    listed = set(re.findall(r"^\| `([^`]+)` \|", index.read_text(), re.M))
    present = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != index}
    assert not present - listed, f"result files missing from {index} (python benchmarks/results_index.py): " \
                                 f"{sorted(present - listed)}"
    assert not listed - present, f"{index} lists files that do not exist: {sorted(listed - present)}"
