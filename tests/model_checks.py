"""Model-level comparisons (docs/format.md, section 7): a runtime's packed cache after a prefill against
the eager reference. The runtime computed its own projections, whose last bits depend on the CPU, so
mismatches are counted as fractions over all layers, K and V, and held under the documented bounds."""

from __future__ import annotations

import numpy as np
import torch

from oscar_export.codec import unpack_codes
from oscar_export.parity import ARTIFACT_THRESHOLDS

BOUNDS = {"codes": ARTIFACT_THRESHOLDS["codes_mismatch_fraction"], "scale": 1e-2, "zero": 1e-2}
LOGITS_RTOL = ARTIFACT_THRESHOLDS["logits_max_rel_error"]


def logits_rel_error(got, want) -> float:
    """Worst step's ||got - want|| / ||want||, as parity measures logits."""
    return max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in zip(got, want))


def body_mismatches(pairs, bits: dict[str, int]) -> dict[str, tuple[int, int]]:
    """pairs: (kind, region, got, want) body arrays. Codes are counted per code, scales and zeros per value."""
    counts = {}
    for kind, region, got, want in pairs:
        assert got.shape == want.shape and got.dtype == want.dtype, f"{kind}_{region}: layout differs"
        if region == "codes":
            got, want = (unpack_codes(torch.from_numpy(np.ascontiguousarray(a)), bits[kind]).numpy()
                         for a in (got, want))
        else:
            got, want = got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}")
        differ, total = counts.get(region, (0, 0))
        counts[region] = (differ + int((got != want).sum()), total + got.size)
    return counts


def layer_body_mismatches(got: dict, want: dict, k_bits_by_layer, v_bits: int, body: int | None = None,
                          regions=("codes", "scale", "zero")) -> dict:
    """body_mismatches over every layer's first `body` body slots (all when None), each layer's K codes at its
    own width. got and want: arrays by layer{i}.{kind}_{region}."""
    counts = {}
    for i, k_bits in enumerate(k_bits_by_layer):
        assert got[f"layer{i}.k_codes"].shape[-1] == want[f"layer{i}.k_codes"].shape[-1], f"layer {i}: K width"
        pairs = [(kind, region, got[f"layer{i}.{kind}_{region}"][:, :body], want[f"layer{i}.{kind}_{region}"][:, :body])
                 for kind in "kv" for region in regions]
        for region, (differ, total) in body_mismatches(pairs, {"k": k_bits, "v": v_bits}).items():
            counts[region] = (counts.get(region, (0, 0))[0] + differ, counts.get(region, (0, 0))[1] + total)
    return counts


def assert_within_bounds(counts: dict[str, tuple[int, int]], what: str) -> None:
    assert counts, f"{what}: nothing was compared"
    print(f"{what}: " + ", ".join(f"{region} {differ}/{total} ({differ / total:.2e})"
                                  for region, (differ, total) in counts.items()))
    for region, (differ, total) in counts.items():
        assert total and differ <= BOUNDS[region] * total, \
            f"{what}: {differ} of {total} {region} differ, over the bound {BOUNDS[region]:g}"
