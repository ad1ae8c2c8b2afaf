"""OscarConfig: every knob of the packed KV-cache format, validated once."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

SUPPORTED_BITS = (2, 3, 4)
SUPPORTED_CLUSTER_DIMS = (32, 64, 128)
CODEBOOKS = ("uniform", "lloyd-max")
ROUNDINGS = ("nearest", "feedback")
SCALE_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")


class OscarInputError(ValueError):
    """Bad user input. The message names the input and what is allowed."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise OscarInputError(message)


def _flag(default, help: str, choices=None, count: bool = False, only_where_scales_are_stored: bool = False):
    """A field that is also a command-line flag (--k-bits for k_bits); `help` may name {default}. count: a token
    count >= 0."""
    return field(default=default, metadata={"help": help, "choices": choices, "count": count,
                                            "scales": only_where_scales_are_stored})


@dataclass(frozen=True)
class OscarConfig:
    """Format of the OSCAR KV cache. Defaults and their reasons are in docs/format.md."""

    k_bits: int = _flag(2, "bits per K code (overrides --bits)", SUPPORTED_BITS)
    v_bits: int = _flag(2, "bits per V code (overrides --bits)", SUPPORTED_BITS)
    cluster_dim: int = _flag(64, "quantization group along head_dim (default {default}, or the largest group that "
                                 "divides the model's head_dim when {default} does not)", SUPPORTED_CLUSTER_DIMS)
    k_clip: float = _flag(1.0, "fraction of each K group's range kept (default: a rotation file's, else {default})")
    v_clip: float = _flag(1.0, "fraction of each V group's range kept (default: a rotation file's, else {default})")
    codebook: str = "uniform"
    sink: int = _flag(64, "fp16 sink tokens (default: a budget-chosen rotation file's, else {default})", count=True)
    recent: int = _flag(256, "fp16 recent window (default: a budget-chosen rotation file's, else {default})",
                        count=True)
    scale_dtype: str = _flag("float16", "how each group's scale and zero are stored (default {default}); "
                             "float8_e4m3fn: one byte each, a quarter bit per element less at group 64 "
                             "(docs/format.md); exports: android and laptop store either, ios and laptop's pure-ONNX "
                             "fallback float16 only", SCALE_DTYPES, only_where_scales_are_stored=True)
    # K's width and clip per layer, for a cache whose sensitive layers get one more bit (calibrate --budget-bits
    # chooses them). Empty: every layer has k_bits and k_clip. Given: k_bits is the narrowest width, the base.
    k_bits_by_layer: tuple[int, ...] = ()
    k_clip_by_layer: tuple[float, ...] = ()
    # How K's codes are chosen: each element to its nearest level, or with the rounding errors fed forward to the
    # later channels, weighted so the error lands where the queries read least (needs the calibration's k_feedback).
    k_rounding: str = _flag("nearest", "how K codes are chosen: nearest level, or feedback (rounding errors moved to "
                            "the directions queries read least; needs calibrated rotations) (default: a rotation "
                            "file's; feedback where the command calibrates; else {default})", ROUNDINGS)

    def __post_init__(self) -> None:
        # JSON gives lists; frozen fields are compared and hashed as tuples.
        for name in ("k_bits_by_layer", "k_clip_by_layer"):
            value = getattr(self, name)
            _check(isinstance(value, (list, tuple)), f"{name}={value!r}: expected a list, one entry per layer")
            object.__setattr__(self, name, tuple(value))
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
        _check(self.k_rounding in ROUNDINGS, f"k_rounding={self.k_rounding!r}: expected one of {ROUNDINGS}")
        # Lloyd-Max levels are the centroids of nearest rounding, not of rounding with feedback.
        _check(self.k_rounding == "nearest" or self.codebook == "uniform",
               f"k_rounding={self.k_rounding!r} with codebook={self.codebook!r}: expected codebook='uniform'")
        if self.k_bits_by_layer or self.k_clip_by_layer:
            self._check_by_layer()

    def _check_by_layer(self) -> None:
        widths, clips = self.k_bits_by_layer, self.k_clip_by_layer
        _check(len(widths) == len(clips) > 0, f"k_bits_by_layer has {len(widths)} entries and k_clip_by_layer "
               f"{len(clips)}: expected both, one entry per layer")
        for i, (bits, clip) in enumerate(zip(widths, clips)):
            try:
                OscarConfig(k_bits=bits, k_clip=clip)  # the checks of a whole-cache width and clip
            except OscarInputError as error:
                raise OscarInputError(f"layer {i} of k_bits_by_layer / k_clip_by_layer: {error}") from None
        _check(self.k_bits == min(widths), f"k_bits={self.k_bits} with k_bits_by_layer {list(widths)}: expected "
               f"k_bits={min(widths)}, the narrowest layer's width")
        # Lloyd-Max levels are one table of 2**bits levels per kind and layer, fitted at one width.
        _check(self.codebook == "uniform", f"codebook={self.codebook!r} with k_bits_by_layer: expected 'uniform'")

    def check_head_dim(self, head_dim: int) -> None:
        """cluster_dim groups must tile head_dim exactly."""
        _check(
            isinstance(head_dim, int) and head_dim > 0 and head_dim % self.cluster_dim == 0,
            f"cluster_dim={self.cluster_dim} does not divide head_dim={head_dim}: "
            f"expected a cluster_dim in {tuple(c for c in SUPPORTED_CLUSTER_DIMS if head_dim % c == 0)}",
        )

    @property
    def mixed(self) -> bool:
        """K's width differs between layers: ask layer(i) for a layer's format."""
        return bool(self.k_bits_by_layer)

    def bits(self, kind: str) -> int:
        if kind == "k" and self.mixed:
            raise OscarInputError("K's width is per layer in this config (k_bits_by_layer): expected a "
                                  "question about one layer, config.layer(i)")
        return {"k": self.k_bits, "v": self.v_bits}[kind]

    def clip(self, kind: str) -> float:
        if kind == "k" and self.mixed:
            raise OscarInputError("K's clip is per layer in this config (k_clip_by_layer): expected a "
                                  "question about one layer, config.layer(i)")
        return {"k": self.k_clip, "v": self.v_clip}[kind]

    def check_layers(self, layers: int) -> None:
        _check(not self.mixed or len(self.k_bits_by_layer) == layers,
               f"k_bits_by_layer has {len(self.k_bits_by_layer)} entries: expected one per layer, {layers}")

    def layer(self, i: int) -> "OscarConfig":
        """Layer i's format, with one K width."""
        if not self.mixed:
            return self
        return replace(self, k_bits=self.k_bits_by_layer[i], k_clip=self.k_clip_by_layer[i], k_bits_by_layer=(),
                       k_clip_by_layer=())

    def layers(self, count: int) -> list["OscarConfig"]:
        """Every layer's format, for a model of `count` layers."""
        self.check_layers(count)
        return [self.layer(i) for i in range(count)]

    def describe(self) -> str:
        """K2/V2, K2 (3 in 16 of 30 layers)/V2, or either with ", K feedback" and ", float8_e4m3fn scales"."""
        suffix = ", K feedback" if self.k_rounding == "feedback" else ""
        if self.scale_dtype != "float16":
            suffix += f", {self.scale_dtype} scales"
        if not self.mixed:
            return f"K{self.k_bits}/V{self.v_bits}{suffix}"
        wider = sum(bits > self.k_bits for bits in self.k_bits_by_layer)
        top = max(self.k_bits_by_layer)
        return f"K{self.k_bits} ({top} in {wider} of {len(self.k_bits_by_layer)} layers)/V{self.v_bits}{suffix}"

    @property
    def scale_bytes(self) -> int:
        return {"float32": 4, "float8_e4m3fn": 1}.get(self.scale_dtype, 2)

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in ("k_bits_by_layer", "k_clip_by_layer"):
            data[name] = list(data[name])
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "OscarConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        _check(not unknown, f"OscarConfig: unknown fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)

    @classmethod
    def flag_fields(cls, scales: bool = True) -> list:
        """The fields that are command-line flags (dataclasses.Field, help and choices in .metadata); `scales`:
        also those that only commands storing scales take."""
        return [f for f in fields(cls) if f.metadata.get("help") and (scales or not f.metadata["scales"])]

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


def with_metadata_defaults(fields: dict, metadata: dict | None) -> dict:
    """`fields` (OscarConfig fields, None where the user set none) completed by a rotation file's metadata: its
    clip ratios, codebook and K rounding, and the whole format when `calibrate --budget-bits` chose it (bits, group,
    windows, scale dtype, per-layer K). A K width or clip the user gives holds for every layer, so the file's per-layer K then
    does not apply."""
    meta = metadata or {}
    keys = ("k_clip", "v_clip", "codebook", "k_rounding")
    if meta.get("budget_bits") is not None:
        keys += ("k_bits", "v_bits", "cluster_dim", "sink", "recent", "scale_dtype")
        if fields.get("k_bits") is None and fields.get("k_clip") is None:
            keys += ("k_bits_by_layer", "k_clip_by_layer")
    filled = dict(fields)
    for key in keys:
        if filled.get(key) is None and meta.get(key) is not None:
            filled[key] = meta[key]
    return filled


def config_for(metadata: dict | None, head_dim: int | None = None, **fields) -> OscarConfig:
    """OscarConfig from the given fields (None: unset); a rotation file's metadata fills in the rest
    (with_metadata_defaults), and an unset cluster_dim is then the default group for head_dim."""
    fields = with_metadata_defaults(fields, metadata)
    if fields.get("cluster_dim") is None:
        fields["cluster_dim"] = default_cluster_dim(head_dim)
    return OscarConfig(**{key: value for key, value in fields.items() if value is not None})
