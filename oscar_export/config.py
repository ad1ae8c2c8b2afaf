"""OscarConfig: every knob of the packed KV-cache format, validated once."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

SUPPORTED_BITS = (2, 3, 4)
SUPPORTED_CLUSTER_DIMS = (32, 64, 128)
CODEBOOKS = ("uniform", "lloyd-max")
SCALE_DTYPES = ("float16", "bfloat16", "float32")


class OscarInputError(ValueError):
    """Bad user input. The message names the input and what is allowed."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise OscarInputError(message)


@dataclass(frozen=True)
class OscarConfig:
    """Format of the OSCAR KV cache. Defaults and their reasons are in docs/format.md."""

    k_bits: int = 2
    v_bits: int = 2
    cluster_dim: int = 64
    k_clip: float = 1.0
    v_clip: float = 1.0
    codebook: str = "uniform"
    sink: int = 64
    recent: int = 256
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and value in SUPPORTED_BITS,
                f"{name}={value!r}: expected one of {SUPPORTED_BITS}",
            )
        _check(
            isinstance(self.cluster_dim, int) and self.cluster_dim in SUPPORTED_CLUSTER_DIMS,
            f"cluster_dim={self.cluster_dim!r}: expected one of {SUPPORTED_CLUSTER_DIMS}",
        )
        for name in ("k_clip", "v_clip"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0.5 <= value <= 1.0,
                f"{name}={value!r}: expected a fraction of the range kept, 0.5 <= clip <= 1.0",
            )
        _check(self.codebook in CODEBOOKS, f"codebook={self.codebook!r}: expected one of {CODEBOOKS}")
        for name in ("sink", "recent"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and value >= 0,
                f"{name}={value!r}: expected a token count >= 0",
            )
        _check(
            self.scale_dtype in SCALE_DTYPES,
            f"scale_dtype={self.scale_dtype!r}: expected one of {SCALE_DTYPES}",
        )

    def check_head_dim(self, head_dim: int) -> None:
        """cluster_dim groups must tile head_dim exactly."""
        _check(
            isinstance(head_dim, int) and head_dim > 0 and head_dim % self.cluster_dim == 0,
            f"cluster_dim={self.cluster_dim} does not divide head_dim={head_dim}: "
            f"expected a cluster_dim in {tuple(c for c in SUPPORTED_CLUSTER_DIMS if head_dim % c == 0)}",
        )

    def bits(self, kind: str) -> int:
        return {"k": self.k_bits, "v": self.v_bits}[kind]

    def clip(self, kind: str) -> float:
        return {"k": self.k_clip, "v": self.v_clip}[kind]

    @property
    def scale_bytes(self) -> int:
        return 4 if self.scale_dtype == "float32" else 2

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "OscarConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        _check(not unknown, f"OscarConfig: unknown fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)

    @classmethod
    def reference_recipe(cls, cluster_dim: int = 128) -> "OscarConfig":
        """The paper's recipe: 2-bit K/V, clip K 0.96 and V 0.92, 64 sink, 256 recent."""
        return cls(cluster_dim=cluster_dim, k_clip=0.96, v_clip=0.92)


def default_cluster_dim(head_dim: int | None) -> int:
    """The group used when none is asked for: 64 where it divides head_dim (the recommended group), else the
    largest supported group that does (32 for head_dim 32 or 96)."""
    fitting = [c for c in SUPPORTED_CLUSTER_DIMS if head_dim and head_dim % c == 0]
    preferred = OscarConfig.cluster_dim
    if head_dim is None or preferred in fitting or not fitting:
        return preferred
    return max(fitting)


def metadata_defaults(metadata: dict | None) -> dict:
    """Cache format fields a rotation file's metadata gives where the user set none: its clip ratios and
    codebook, and the whole format when `calibrate --budget-bits` chose it (bits, group, windows)."""
    meta = metadata or {}
    keys = ("k_clip", "v_clip", "codebook")
    if meta.get("budget_bits") is not None:
        keys += ("k_bits", "v_bits", "cluster_dim", "sink", "recent")
    return {key: meta[key] for key in keys if meta.get(key) is not None}
