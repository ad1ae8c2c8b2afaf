"""Calibrated rotations on demand: `--rotations calibrate`, cached by what made them.

A calibration depends on the model's files, the calibration text, the token counts and the
cache format it is searched for (bits and group: the clip search tries them); sink and recent
windows do not enter it. Those go into a key; a calibration with that key is reused from the
cache directory (`$OSCAR_EXPORT_CACHE`, else `$XDG_CACHE_HOME/oscar-export`, else
`~/.cache/oscar-export`), or from the file the bundled model ships, so set-up and tests do not
pay for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from ..config import OscarConfig, OscarInputError

# Calibration text and token counts of `--rotations calibrate`; `calibrate` the command takes the same.
DEFAULT_TOKENS = 16384
DEFAULT_HELDOUT_TOKENS = 512
SHIPPED_FILES = "calibration*.safetensors"  # beside the bundled model's weights, one per shipped format
# How K is rounded where a command calibrates and no flag says: feedback weights come from the calibration itself
# and, on SmolLM2, buy about what one more K bit does (docs/calibration.md).
CALIBRATED_K_ROUNDING = "feedback"
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".gguf", ".model", ".txt")


def default_text() -> Path:
    from ..models import BUNDLED_TEXT

    return BUNDLED_TEXT


def read_text(path) -> tuple[str, str]:
    """A calibration text and its sha256; not UTF-8 or missing is an input error naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise OscarInputError(f"calibration text {str(path)!r}: cannot read ({err.strerror or err}): "
                              f"expected a UTF-8 text file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise OscarInputError(f"calibration text {str(path)!r} is not UTF-8 (byte {err.start}): "
                              f"expected a UTF-8 text file") from None
    return text, hashlib.sha256(raw).hexdigest()


def model_digest(model_name: str) -> str:
    """sha256 over the checkpoint's files (config, weights, tokenizer), each by name and content."""
    from ..models import is_gguf, model_dir

    def sha256(path: Path) -> str:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    if is_gguf(model_name):  # one file holds weights, tokenizer and config
        return sha256(Path(model_name).expanduser())
    directory = model_dir(model_name)
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES
                       and not p.match(SHIPPED_FILES)):
        digest.update(f"{path.name}\0{sha256(path)}\0".encode())
    return digest.hexdigest()


def cache_key(model_name: str, text_sha256: str, tokens: int, heldout_tokens: int, config: OscarConfig,
              choice: dict | None = None) -> str:
    """choice: what a format chooser's result depends on (its budget, context and search), beside the base format."""
    from .fit import CLIP_CANDIDATES, FEEDBACK_K_CLIP_FLOOR

    fields = {"model": model_digest(model_name), "text": text_sha256, "tokens": tokens, "heldout": heldout_tokens,
              "k_bits": config.k_bits, "v_bits": config.v_bits, "cluster_dim": config.cluster_dim,
              "scale_dtype": config.scale_dtype, "method": "oscar U.H.P_br, windows spread over the model's context",
              "clip_candidates": list(CLIP_CANDIDATES)}
    if config.k_rounding != "nearest":  # the clip search rounds as the cache will; nearest keeps the older keys
        fields["k_rounding"] = config.k_rounding
        fields["k_clip_floor"] = FEEDBACK_K_CLIP_FLOOR
    fields.update({f"choice_{key}": value for key, value in (choice or {}).items()})
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def cache_dir() -> Path:
    if os.environ.get("OSCAR_EXPORT_CACHE"):
        return Path(os.environ["OSCAR_EXPORT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "oscar-export"


def run_calibration(model_name: str, config: OscarConfig, text_path, tokens: int, heldout_tokens: int,
                    per_head: bool = False, lloyd_max: bool = False, model=None, tokenizer=None, choose=None):
    """Calibrate and return (RotationSet, seconds); the metadata says how the rotations were made.
    choose: None fits `config`'s clips and levels; else a callable (model, tokenizer, fitted rotations, text) ->
    (config, quantizer, metadata) that picks the format itself (evaluate.budget.format_chooser: the budget search),
    whose metadata joins the file's, so export and eval take the format from it."""
    from .fit import fit_quantizer, fit_rotations
    from ..models import load_model
    from .files import ZOO_OBJECTIVES, RotationSet

    text, text_sha256 = read_text(text_path)
    start = time.perf_counter()
    if model is None:
        model, tokenizer = load_model(model_name)
    fitted = fit_rotations(model, tokenizer, text, tokens, heldout_tokens, per_head=per_head,
                           text_name=f"calibration text {str(text_path)!r}")
    if choose is not None:
        config, result, chosen = choose(model, tokenizer, fitted, text)
    else:
        result, chosen = fit_quantizer(fitted, config, lloyd_max), {}
    seconds = round(time.perf_counter() - start, 1)
    metadata = {
        "model": model_name,
        "method": "calibrate",
        "objective": "oscar",
        "composition": "U.H.P_br",
        # The reference's names: K fitted on q q^T, V on s s^T, composed as U then H then P_br (h_pbr).
        "k_objective": ZOO_OBJECTIVES["k"],
        "v_objective": ZOO_OBJECTIVES["v"],
        "source_grouping": "layer",
        "k_clip": result["k_clip"],
        "v_clip": result["v_clip"],
        "k_clip_errors": {str(c): round(e, 6) for c, e in result["k_clip_errors"].items()},
        "v_clip_errors": {str(c): round(e, 6) for c, e in result["v_clip_errors"].items()},
        "codebook": "lloyd-max" if lloyd_max else "uniform",
        "k_rounding": config.k_rounding,
        "k_bits": config.k_bits,
        "v_bits": config.v_bits,
        "cluster_dim": config.cluster_dim,
        "scale_dtype": config.scale_dtype,  # the clips were searched with it
        "calibration_tokens": tokens,
        "calibration_positions": fitted["positions"],  # the calibration windows' offsets span [0, this)
        "heldout_tokens": heldout_tokens,
        # The bundled text by name: the shipped calibration must not carry the path of the machine that made it.
        "calibration_text": "bundled heldout.txt" if Path(text_path) == default_text() else str(text_path),
        "calibration_text_sha256": text_sha256,
        "seconds": seconds,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    metadata.update(chosen)  # the whole format a chooser picked, which export and eval then take from the file
    rotation_set = RotationSet(
        k=result["k_rotation"], v=result["v_rotation"], metadata=metadata,
        k_levels=result.get("k_levels"), v_levels=result.get("v_levels"),
        k_eigenvalues=result["k_eigenvalues"], v_eigenvalues=result["v_eigenvalues"], k_feedback=result["k_feedback"],
    )
    return rotation_set, seconds


def calibrated_rotations(model_name: str, config: OscarConfig, text_path=None, tokens: int = DEFAULT_TOKENS,
                         heldout_tokens: int = DEFAULT_HELDOUT_TOKENS, store: Path | None = None, choose=None,
                         choice: dict | None = None) -> tuple[Path, bool]:
    """A rotation file calibrated for this model, text and format: (path, reused). Calibrates on a miss and
    stores the result in the cache directory, or at `store`. choose: a format chooser (run_calibration), with
    `choice` the fields its result depends on, which join the key."""
    from ..models import BUNDLED_MODEL_DIR
    from .files import load_rotations, save_rotations

    text_path = Path(text_path) if text_path is not None else default_text()
    _, text_sha256 = read_text(text_path)
    key = cache_key(model_name, text_sha256, tokens, heldout_tokens, config, choice)
    candidates = [store or cache_dir() / f"{key[:32]}.safetensors"]
    if model_name == "bundled":
        candidates[:0] = sorted(BUNDLED_MODEL_DIR.glob(SHIPPED_FILES))
    for path in candidates:
        try:
            if path.is_file() and load_rotations(path).metadata.get("cache_key") == key:
                return path, True
        except OscarInputError:  # a damaged cache entry is calibrated again and replaced
            pass
    path = candidates[-1]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OscarInputError(f"calibration cache {str(path.parent)!r}: cannot create ({err.strerror or err}): "
                              f"expected a writable directory (set OSCAR_EXPORT_CACHE)") from None
    rotation_set, _ = run_calibration(model_name, config, text_path, tokens, heldout_tokens, choose=choose)
    rotation_set.metadata["cache_key"] = key
    save_rotations(path, rotation_set)
    return path, False
