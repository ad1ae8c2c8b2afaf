"""bench memory (oscar_export/bench/memory.py) on an artifact of any target: the same checks."""

from __future__ import annotations

import json

import pytest

from oscar_export.config import OscarInputError
from oscar_export.bench.memory import bench_artifact_memory


def check_bench_memory(artifact) -> None:
    """A fresh process's measurements in their order, the plan it is judged against, a bad context named."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    plan = manifest["plan"]
    report = bench_artifact_memory(artifact, context=manifest["max_context"] // 2, steps=2, threads=1,
                                   device_memory="1GB")
    assert 0 < report["rss_before_load"] < report["rss_after_load"] <= report["peak_rss"]
    assert report["rss_after_fill"] <= report["peak_rss"] and len(report["step_ms"]) == 2
    assert report["planned_bytes"] == plan["weights_bytes"] + plan["kv_bytes"]
    assert report["budget_bytes"] == 2**30 - report["plan"]["reserve_bytes"] > 0
    assert report["fits_budget"] == (report["peak_rss"] <= report["budget_bytes"])
    assert report["overhead_bytes"] == report["peak_rss"] - report["planned_bytes"]
    with pytest.raises(OscarInputError, match="--context 2: expected steps = 2 < context"):
        bench_artifact_memory(artifact, context=2, steps=2)
