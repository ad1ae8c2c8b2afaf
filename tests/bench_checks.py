"""bench attention's traffic columns (oscar_export/bench/common.py), the same on every runtime: the bytes
a decode step reads against the cache sizes the planner computes, and the rates derived from them."""

from __future__ import annotations

import pytest

from oscar_export.sizes import cache_bytes
from oscar_export.config import OscarConfig


def check_step_traffic(report: dict, int8: bool = False) -> None:
    config = OscarConfig.from_dict(report["config"])
    kv, d = report["kv_heads"], report["head_dim"]
    assert report["copy_GBps"] > 0
    for row in report["results"]:
        n = row["context"]
        expected = {"oscar": cache_bytes(config, 1, kv, d, n), "baseline": 2 * n * kv * d * 4}
        if int8:  # int8 codes, an fp32 scale and an int8 zero point per token and head, for K and V
            expected["int8"] = 2 * n * kv * (d + 4 + 1)
        for name, nbytes in expected.items():
            assert row[f"{name}_bytes"] == nbytes, (name, row)
            assert row[f"{name}_GBps"] == pytest.approx(nbytes / (row[f"{name}_ms"] * 1e6), rel=1e-2, abs=1e-3)
            assert row[f"{name}_fraction_of_copy"] == pytest.approx(row[f"{name}_GBps"] / report["copy_GBps"],
                                                                   rel=1e-2, abs=1e-3)
