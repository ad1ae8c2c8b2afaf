"""Method objects: a spec (see specs.method_config) turned into its cache config and a factory of fresh caches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..config import OscarConfig, OscarInputError
from ..hf_cache import attention_shape
from ..calibration.rotations import hadamard_rotations
from .baselines import EvalOscarKVCache, Fp16Cache, KiviCache, OnlineOscarKVCache
from .specs import method_config


@dataclass
class Method:
    """One evaluated cache: its format config and a factory of fresh caches for `max_context` tokens."""

    name: str
    config: OscarConfig | None
    make: Callable[[int], object]
    rotation: str
    notes: list[str] = field(default_factory=list)


def _oscar_factory(config, shape, k_rot=None, v_rot=None, k_levels=None, v_levels=None, cls=EvalOscarKVCache,
                   k_feedback=None):
    layers, kv_heads, head_dim, _ = shape
    return lambda n: cls(config, layers, kv_heads, head_dim, n, k_rot, v_rot, k_levels, v_levels, k_feedback=k_feedback)


def _levels_for(levels, bits: int):
    return levels if levels is not None and levels.shape[-1] == 2**bits else None


def oscar_from_rotations(rotations, config: OscarConfig, shape, source: str, label: str | None = None,
                         name: str = "oscar") -> Method:
    """The `oscar` method from a RotationSet-like object (.k, .v, .k_levels, .v_levels, .k_feedback, .metadata).

    Its clip ratios (and codebook, when Lloyd-Max levels for these bits are present) come from the
    metadata; what the metadata does not give comes from `config`. K rounding with feedback needs the
    object's k_feedback.
    """
    meta = getattr(rotations, "metadata", None) or {}
    notes = []
    changes = {key: meta[key] for key in ("k_clip", "v_clip") if meta.get(key) is not None}
    k_levels = _levels_for(getattr(rotations, "k_levels", None), config.k_bits)
    v_levels = _levels_for(getattr(rotations, "v_levels", None), config.v_bits)
    if meta.get("codebook") == "lloyd-max" or config.codebook == "lloyd-max":
        if k_levels is not None and v_levels is not None:
            changes["codebook"] = "lloyd-max"
        else:
            changes["codebook"] = "uniform"
            notes.append(f"no Lloyd-Max levels for K{config.k_bits}/V{config.v_bits} bits in {source}: uniform levels used")
    if changes.get("codebook", config.codebook) == "uniform":
        k_levels = v_levels = None
    for key in ("k_bits", "v_bits"):
        if meta.get(key) is not None and meta[key] != getattr(config, key):
            notes.append(f"{source} was calibrated for {key}={meta[key]}; evaluated at {getattr(config, key)}")
    cfg = replace(config, **changes)
    feedback = getattr(rotations, "k_feedback", None) if cfg.k_rounding == "feedback" else None
    if cfg.k_rounding == "feedback" and feedback is None:
        raise OscarInputError(f"k_rounding='feedback' needs K's feedback weights: {source} has none (expected a "
                              f"rotation file from oscar-export calibrate)")
    return Method(name, cfg, _oscar_factory(cfg, shape, rotations.k, rotations.v, k_levels, v_levels,
                                            k_feedback=feedback), label or f"file {source}", notes)


@dataclass
class _Calibrated:
    k: torch.Tensor
    v: torch.Tensor
    k_levels: torch.Tensor | None
    v_levels: torch.Tensor | None
    metadata: dict
    k_feedback: torch.Tensor | None = None


def oscar_method(model, tokenizer, spec, config, shape, rotations, calibration, fitted,
                  per_head: bool = False) -> Method:
    """`oscar` at `config`: from `rotations` (a file or RotationSet), else calibrated on `calibration`
    (text, tokens, held-out tokens), one rotation per KV head with `per_head`; `fitted` keeps the
    rotation fit for the other bit widths."""
    layers, kv_heads, head_dim, _ = shape
    if rotations is not None and not isinstance(rotations, (str, Path)):
        return oscar_from_rotations(rotations, config, shape, "the given rotation set", "given rotation set", spec)
    if rotations is not None:
        from ..calibration.files import load_rotations

        rs = load_rotations(rotations, layers=layers, head_dim=head_dim, kv_heads=kv_heads)
        return oscar_from_rotations(rs, config, shape, str(rotations), None, spec)
    text, tokens, heldout = calibration
    if text is None:
        raise OscarInputError("methods: 'oscar' without rotations needs calibration text")
    from ..calibration.fit import fit_quantizer, fit_rotations

    if not fitted:
        fitted.update(fit_rotations(model, tokenizer, text, tokens, heldout, per_head=per_head,
                                    text_name="calibration part of the evaluation text"))
    result = fit_quantizer(fitted, config, lloyd_max=config.codebook == "lloyd-max")
    meta = {"k_clip": result["k_clip"], "v_clip": result["v_clip"], "codebook": config.codebook}
    calibrated = _Calibrated(result["k_rotation"], result["v_rotation"], result.get("k_levels"),
                             result.get("v_levels"), meta, result["k_feedback"])
    method = oscar_from_rotations(calibrated, config, shape, "calibration", "calibrated", spec)
    method.notes.append(f"clip K {result['k_clip']:g}, V {result['v_clip']:g} (searched on the held-out "
                        f"calibration tokens)")
    return method


def build_methods(model, tokenizer, names: Sequence[str], config: OscarConfig, rotations=None,
                  calibration_text: str | None = None, calibration_tokens: int = 4096,
                  calibration_heldout: int = 512, match_clip: bool = False, per_head: bool = False) -> list[Method]:
    """Method objects for the specs `names` (see method_config), in that order.

    Baselines use the uniform codebook and nearest rounding (feedback weights come from calibration data they do
    not have); `oscar` takes its clip ratios (and Lloyd-Max levels, K feedback weights) from the
    rotation file or the calibration, which fits the rotations once for every bit width. match_clip:
    the quantized baselines use the first oscar method's clip ratios too, so only the rotation (or
    KIVI's grouping) differs. per_head: calibrated oscar fits one rotation per KV head.
    """
    shape = attention_shape(model)
    layers, kv_heads, head_dim, _ = shape
    config.check_head_dim(head_dim)
    specs = [(spec, *method_config(spec, config)) for spec in names]
    calibration, fitted = (calibration_text, calibration_tokens, calibration_heldout), {}
    oscars = {spec: oscar_method(model, tokenizer, spec, cfg, shape, rotations, calibration, fitted, per_head)
              for spec, name, cfg in specs if name == "oscar"}
    clips = {}
    if match_clip:
        if not oscars:
            raise OscarInputError("match_clip: expected 'oscar' among the methods (its clip ratios are matched)")
        first = next(iter(oscars.values())).config
        clips = {"k_clip": first.k_clip, "v_clip": first.v_clip}
    methods = []
    for spec, name, cfg in specs:
        base = replace(cfg, codebook="uniform", k_rounding="nearest", **clips)
        if name == "fp16":
            methods.append(Method(spec, None, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), "none"))
        elif name == "naive":
            methods.append(Method(spec, base, _oscar_factory(base, shape), "none"))
        elif name == "hadamard":
            rot = hadamard_rotations(layers, head_dim)
            methods.append(Method(spec, base, _oscar_factory(base, shape, rot, rot), "hadamard"))
        elif name == "kivi":
            methods.append(Method(spec, base, lambda n, b=base: KiviCache(b, layers, kv_heads, head_dim, n),
                                  "none (K per channel, V per token)"))
        elif name == "online":
            methods.append(Method(spec, base, _oscar_factory(base, shape, cls=OnlineOscarKVCache),
                                  "online (from each sequence's first chunk)"))
        else:
            methods.append(oscars[spec])
    return methods
