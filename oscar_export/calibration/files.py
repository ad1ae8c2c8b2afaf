"""Rotation files: the project's safetensors format and the official RotationZoo .pt files.

Our format is one safetensors file holding `k_rotation` and `v_rotation` (fp32
[layers, D, D] per layer, or [layers, kv_heads, D, D] per KV head), optional `k_levels`,
`v_levels` (Lloyd-Max levels in code units, [layers, 2**bits]), optional `k_eigenvalues`,
`v_eigenvalues` (the rotation's leading shape without the last D) and optional `k_feedback` (K's
error-feedback weights, fp32 [layers, kv_heads, D, D], for k_rounding 'feedback'). The header metadata holds
`format_version` "1" and the set's metadata as JSON under `oscar`.

RotationZoo files are pickled dicts, one for K and one for V, each with its own objective:
`{format_version, objective, source_grouping, layers: {layer_id: {layer_id, rotation, eigenvalues}}}`
(layer ids int or str),
rotation fp32 [d, d] (or [kv_heads, d, d] from format_version 2), eigenvalues [d] (or
[kv_heads, d]). They are read with weights_only, so a pickle that carries code is refused
without running it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..codec import check_feedback, check_finite, check_levels
from ..config import SUPPORTED_BITS, OscarConfig, OscarInputError
from .rotations import max_orthogonality_error, orthogonality_errors

# What --rotations takes besides a rotation file.
ROTATION_MODES = ("online", "hadamard", "none")

FORMAT_VERSION = "1"
ORTHOGONALITY_TOLERANCE = 1e-4
KINDS = ("k", "v")
TENSOR_NAMES = ("k_rotation", "v_rotation", "k_levels", "v_levels", "k_eigenvalues", "v_eigenvalues", "k_feedback")
ZOO_KEYS = ("format_version", "objective", "source_grouping", "layers")
ZOO_LAYER_KEYS = ("rotation", "eigenvalues")
ZOO_VERSIONS = (1, 2)
CONFIG_METADATA = ("k_bits", "v_bits", "cluster_dim", "k_clip", "v_clip", "codebook", "k_bits_by_layer",
                   "k_clip_by_layer", "k_rounding", "scale_dtype")
# Our calibration (R = U.H.P_br, K on the query covariance, V score-weighted) in the reference's names.
ZOO_OBJECTIVES = {"k": "qqt_h_pbr", "v": "sst_h_pbr"}


@dataclass(eq=False)  # identity equality: field-wise == on tensors is ambiguous
class RotationSet:
    """K and V rotations for every layer (or every layer and KV head) plus what made them."""

    k: torch.Tensor
    v: torch.Tensor
    metadata: dict = field(default_factory=dict)
    k_levels: torch.Tensor | None = None
    v_levels: torch.Tensor | None = None
    k_eigenvalues: torch.Tensor | None = None
    v_eigenvalues: torch.Tensor | None = None
    k_feedback: torch.Tensor | None = None  # [layers, kv_heads, D, D]

    @property
    def layers(self) -> int:
        return self.k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    @property
    def per_head(self) -> bool:
        return self.k.dim() == 4

    @property
    def kv_heads(self) -> int | None:
        """The KV heads the file is made for: per-head rotations or feedback weights say; None for per-layer
        rotations alone, which serve any KV head."""
        if self.per_head:
            return self.k.shape[1]
        return self.k_feedback.shape[1] if isinstance(self.k_feedback, torch.Tensor) and self.k_feedback.dim() == 4 \
            else None


def _where(index) -> str:
    """Index into [layers] or [layers, kv_heads] -> 'layer 3' or 'layer 3, KV head 1'."""
    index = [int(i) for i in index]
    return f"layer {index[0]}" + (f", KV head {index[1]}" if len(index) == 2 else "")


def _check_orthogonal(name: str, r: torch.Tensor) -> None:
    """r [layers, D, D] or [layers, kv_heads, D, D]: finite and orthogonal, else name the matrix that is not."""
    finite = torch.isfinite(r).flatten(-2).all(-1)
    if not bool(finite.all()):
        at = torch.nonzero(~finite)[0]
        bad = "NaN" if bool(torch.isnan(r[tuple(at)]).any()) else "inf"
        raise OscarInputError(f"{name} at {_where(at)} contains {bad}: expected finite values")
    errors = orthogonality_errors(r)
    worst = torch.unravel_index(errors.argmax(), errors.shape)
    if errors[worst] >= ORTHOGONALITY_TOLERANCE:
        raise OscarInputError(
            f"{name} at {_where(worst)} is not orthogonal: max |R^T R - I| = {float(errors[worst]):.3g}, "
            f"expected < {ORTHOGONALITY_TOLERANCE:g}"
        )


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _check_set(rs: RotationSet, name: str) -> None:
    """Everything a consumer relies on; `name` (a file) starts every message."""
    for kind in KINDS:
        r = getattr(rs, kind)
        if (
            not isinstance(r, torch.Tensor)
            or r.dtype != torch.float32
            or r.dim() not in (3, 4)
            or 0 in r.shape
            or r.shape[-1] != r.shape[-2]
        ):
            raise OscarInputError(
                f"{name}: {kind}_rotation is {_describe(r)}: expected float32 [layers, D, D] "
                f"or [layers, kv_heads, D, D]"
            )
    if rs.k.shape != rs.v.shape:
        raise OscarInputError(
            f"{name}: k_rotation {tuple(rs.k.shape)} and v_rotation {tuple(rs.v.shape)} differ: "
            f"expected the same layers, KV heads and head_dim"
        )
    for kind in KINDS:
        _check_orthogonal(f"{name}: {kind}_rotation", getattr(rs, kind))

    if not isinstance(rs.metadata, dict):
        raise OscarInputError(f"{name}: metadata is {_describe(rs.metadata)}: expected a dict")
    # The cache-format fields a file carries are checked by the one validator every command uses, OscarConfig,
    # so `rotations check`, export and eval accept and refuse the same files.
    format_fields = {key: rs.metadata[key] for key in CONFIG_METADATA if rs.metadata.get(key) is not None}
    try:
        OscarConfig(**format_fields)
    except OscarInputError as err:
        raise OscarInputError(f"{name}: metadata {err}") from None
    if format_fields.get("k_bits_by_layer") and len(format_fields["k_bits_by_layer"]) != rs.layers:
        raise OscarInputError(f"{name}: metadata k_bits_by_layer has {len(format_fields['k_bits_by_layer'])} "
                              f"entries: expected one per layer, {rs.layers}")
    codebook = rs.metadata.get("codebook")
    for kind in KINDS:
        levels = getattr(rs, f"{kind}_levels")
        if codebook is not None and (codebook == "lloyd-max") != (levels is not None):
            raise OscarInputError(
                f"{name}: codebook {codebook!r} but {kind}_levels {'present' if levels is not None else 'absent'}: "
                f"expected levels exactly when the codebook is 'lloyd-max'"
            )
        if levels is None:
            continue
        bits = rs.metadata.get(f"{kind}_bits")
        sizes = tuple(2**b for b in SUPPORTED_BITS if bits in (None, b))
        if (
            not isinstance(levels, torch.Tensor)
            or levels.dtype != torch.float32
            or levels.dim() != 2
            or levels.shape[0] != rs.layers
            or levels.shape[1] not in sizes
        ):
            raise OscarInputError(
                f"{name}: {kind}_levels is {_describe(levels)}: expected float32 [{rs.layers}, L] "
                f"with L in {sizes} ({kind}_bits={bits!r})"
            )
        for i, row in enumerate(levels):
            check_levels(row, levels.shape[1].bit_length() - 1, f"{name}: {kind}_levels[{i}]")

    feedback = rs.k_feedback
    rounding = rs.metadata.get("k_rounding")
    if rounding == "feedback" and feedback is None:
        raise OscarInputError(f"{name}: k_rounding 'feedback' but no k_feedback: expected the weights calibration "
                              f"writes (oscar-export calibrate)")
    if feedback is not None:
        heads = rs.k.shape[1] if rs.per_head else None
        if (not isinstance(feedback, torch.Tensor) or feedback.dtype != torch.float32 or feedback.dim() != 4
                or feedback.shape[0] != rs.layers or feedback.shape[2:] != (rs.head_dim, rs.head_dim)
                or 0 in feedback.shape or heads not in (None, feedback.shape[1])):
            raise OscarInputError(f"{name}: k_feedback is {_describe(feedback)}: expected float32 "
                                  f"[{rs.layers}, {heads or 'kv_heads'}, {rs.head_dim}, {rs.head_dim}]")
        check_feedback(feedback, rs.head_dim, f"{name}: k_feedback")

    for kind in KINDS:
        values = getattr(rs, f"{kind}_eigenvalues")
        if values is None:
            continue
        if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.shape != rs.k.shape[:-1]:
            raise OscarInputError(
                f"{name}: {kind}_eigenvalues is {_describe(values)}: expected floating point "
                f"{tuple(rs.k.shape[:-1])}, one value per rotation column"
            )
        check_finite(f"{name}: {kind}_eigenvalues", values)


def _existing_file(path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise OscarInputError(f"{path}: not a file: expected an existing rotation file")
    return path


def check_writable(path) -> Path:
    """A file path whose directory accepts a new file: checked before minutes of work that end in writing it."""
    path = Path(path)
    if path.is_dir() or not path.parent.is_dir():
        raise OscarInputError(f"{path}: cannot write here: expected a file path in an existing directory")
    probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
    try:
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise OscarInputError(f"{path}: cannot write ({err.strerror or err}): expected a writable file path") from None
    return path


def write_atomically(path, write) -> None:
    """write(temp) beside `path`, then rename over it: readers never see a half-written file."""
    path = check_writable(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temp)
        os.replace(temp, path)
    except (OSError, SafetensorError) as err:
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise OscarInputError(f"{path}: cannot write ({reason}): expected a writable file path") from None
    finally:
        temp.unlink(missing_ok=True)


# -- our format ---------------------------------------------------------------------------


def save_rotations(path, rotation_set: RotationSet) -> None:
    """Validate, then write one safetensors file atomically. layers/head_dim/kv_heads metadata follow the tensors."""
    path = Path(path)
    rs = rotation_set
    _check_set(rs, f"rotation set for {path}")
    metadata = {**rs.metadata, "layers": rs.layers, "head_dim": rs.head_dim, "kv_heads": rs.kv_heads}
    try:
        header = {"format_version": FORMAT_VERSION, "oscar": json.dumps(metadata, sort_keys=True, allow_nan=False)}
    except (TypeError, ValueError) as err:
        raise OscarInputError(f"rotation set for {path}: metadata is not JSON ({err}): expected plain values") from None
    named = dict(zip(TENSOR_NAMES, (rs.k, rs.v, rs.k_levels, rs.v_levels, rs.k_eigenvalues, rs.v_eigenvalues,
                                    rs.k_feedback)))
    # Own contiguous copies: safetensors refuses views and tensors that share memory (K and V may be one tensor).
    tensors = {
        name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in named.items() if t is not None
    }
    write_atomically(path, lambda temp: save_file(tensors, str(temp), metadata=header))


def load_rotations(
    path, *, layers: int | None = None, head_dim: int | None = None, kv_heads: int | None = None
) -> RotationSet:
    """Read and validate a rotation file; layers/head_dim/kv_heads, when given, must match it.

    A per-layer file matches any kv_heads: its rotation serves every KV head of the layer.
    """
    path = _existing_file(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            names = set(f.keys())
            tensors = {name: f.get_tensor(name) for name in names & set(TENSOR_NAMES)}
    except (SafetensorError, OSError) as err:
        raise OscarInputError(
            f"{path}: not a safetensors file ({err}): expected a rotation file; "
            f"RotationZoo .pt files are converted with 'oscar-export rotations convert'"
        ) from None
    if header.get("format_version") != FORMAT_VERSION:
        raise OscarInputError(
            f"{path}: header format_version={header.get('format_version')!r}: "
            f"expected {FORMAT_VERSION!r}, as save_rotations writes"
        )
    try:
        metadata = json.loads(header["oscar"])
    except (KeyError, ValueError):
        metadata = None
    if not isinstance(metadata, dict):
        raise OscarInputError(
            f"{path}: no 'oscar' metadata JSON object in the header: expected one, as save_rotations writes"
        )
    missing = sorted({"k_rotation", "v_rotation"} - names)
    unknown = sorted(names - set(TENSOR_NAMES))
    if missing or unknown:
        raise OscarInputError(
            f"{path}: missing tensors {missing}, unknown tensors {unknown}: "
            f"expected k_rotation, v_rotation and optionally {list(TENSOR_NAMES[2:])}"
        )

    rs = RotationSet(
        k=tensors["k_rotation"],
        v=tensors["v_rotation"],
        metadata=metadata,
        **{name: tensors.get(name) for name in TENSOR_NAMES[2:]},
    )
    _check_set(rs, str(path))
    actual = {"layers": rs.layers, "head_dim": rs.head_dim, "kv_heads": rs.kv_heads}
    for key, value in actual.items():
        if key in metadata and metadata[key] != value:
            raise OscarInputError(f"{path}: metadata says {key}={metadata[key]!r} but the tensors have {value!r}")
    expected = {"layers": layers, "head_dim": head_dim, "kv_heads": kv_heads}
    for key, want in expected.items():
        have = actual[key]
        if want is not None and have is not None and have != want:
            raise OscarInputError(f"{path}: {key}={have} in the file: expected {key}={want} for this model")
    return rs


def check_report(path) -> dict:
    """What `oscar-export rotations check` shows: shape, layout, orthogonality and metadata of a valid file."""
    rs = load_rotations(path)
    return {
        "file": str(path),
        "layers": rs.layers,
        "head_dim": rs.head_dim,
        "per_head": rs.per_head,
        "kv_heads": rs.kv_heads,
        "max_orthogonality_error": max(max_orthogonality_error(rs.k), max_orthogonality_error(rs.v)),
        "metadata": rs.metadata,
    }


# -- RotationZoo ---------------------------------------------------------------------------


def _layer_id(key) -> int | None:
    """A RotationZoo layer key: the reference's loader takes int or str ids ("3")."""
    if type(key) is int:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return None


def _read_zoo(path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One RotationZoo file -> (its header fields, rotations [layers, ...], eigenvalues [layers, ...])."""
    path = _existing_file(path)
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # torch.load raises many types on a corrupt or foreign file
        # When weights_only refuses code, one line of its message names the global (e.g. posix.system).
        refused = next((line.strip().rstrip(".") for line in str(err).splitlines() if "GLOBAL" in line), None)
        what = f"refused to unpickle ({refused})" if refused else f"not a torch file ({type(err).__name__})"
        raise OscarInputError(f"{path}: {what}: expected a RotationZoo .pt file of plain dicts and tensors") from None

    if not isinstance(data, dict):
        raise OscarInputError(f"{path}: holds {_describe(data)}: expected a RotationZoo dict {list(ZOO_KEYS)}")
    missing = [key for key in ZOO_KEYS if key not in data]
    if missing:
        raise OscarInputError(f"{path}: missing keys {missing}: expected a RotationZoo dict with keys {list(ZOO_KEYS)}")
    version = data["format_version"]
    if type(version) is not int or version not in ZOO_VERSIONS:
        raise OscarInputError(f"{path}: format_version={version!r}: expected one of {ZOO_VERSIONS}")
    for key in ("objective", "source_grouping"):
        if not (data[key] is None or isinstance(data[key], str)):
            raise OscarInputError(f"{path}: {key} is {_describe(data[key])}: expected a string")
    layers = data["layers"]
    if not isinstance(layers, dict) or not layers:
        raise OscarInputError(f"{path}: 'layers' is {_describe(layers)}: expected a non-empty dict {{layer_id: entry}}")
    n = len(layers)
    by_id = {}
    for key, entry in layers.items():
        i = _layer_id(key)
        if i is None or not 0 <= i < n:
            raise OscarInputError(f"{path}: layer id {key!r}: expected layer ids 0..{n - 1} (int or str), none missing")
        if i in by_id:
            raise OscarInputError(f"{path}: layer {i} appears twice (as {i!r} and {str(i)!r}): expected one entry")
        by_id[i] = entry

    rotations, eigenvalues = [], []
    for i in range(n):
        entry = by_id[i]
        if not isinstance(entry, dict):
            raise OscarInputError(f"{path}: layer {i} is {_describe(entry)}: expected a dict {list(ZOO_LAYER_KEYS)}")
        missing = [key for key in ZOO_LAYER_KEYS if key not in entry]
        if missing:
            raise OscarInputError(f"{path}: layer {i} is missing {missing}: expected keys {list(ZOO_LAYER_KEYS)}")
        if "layer_id" in entry and _layer_id(entry["layer_id"]) != i:
            raise OscarInputError(f"{path}: layer {i} has layer_id={entry['layer_id']!r}: expected {i}, its key")
        rot, values = entry["rotation"], entry["eigenvalues"]
        if (
            not isinstance(rot, torch.Tensor)
            or rot.dtype != torch.float32
            or rot.dim() not in ((2,) if version == 1 else (2, 3))
            or 0 in rot.shape
            or rot.shape[-1] != rot.shape[-2]
        ):
            layout = "[d, d]" if version == 1 else "[d, d] or [kv_heads, d, d]"
            raise OscarInputError(
                f"{path}: layer {i} rotation is {_describe(rot)}: expected float32 {layout} (format_version {version})"
            )
        if i and rot.shape != rotations[0].shape:
            raise OscarInputError(
                f"{path}: layer {i} rotation has shape {tuple(rot.shape)}: "
                f"expected {tuple(rotations[0].shape)} like layer 0"
            )
        if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.shape != rot.shape[:-1]:
            raise OscarInputError(
                f"{path}: layer {i} eigenvalues are {_describe(values)}: "
                f"expected floating point {tuple(rot.shape[:-1])}"
            )
        if i and values.dtype != eigenvalues[0].dtype:
            raise OscarInputError(
                f"{path}: layer {i} eigenvalues are {values.dtype}: expected {eigenvalues[0].dtype} like layer 0"
            )
        rotations.append(rot)
        eigenvalues.append(values)

    rotation, values = torch.stack(rotations), torch.stack(eigenvalues)
    _check_orthogonal(f"{path}: rotation", rotation)
    check_finite(f"{path}: eigenvalues", values)
    return {key: data[key] for key in ZOO_KEYS[:-1]}, rotation, values


def import_rotation_zoo(k_path, v_path) -> RotationSet:
    """Official RotationZoo K and V files -> RotationSet.

    Each file keeps its own objective (the reference fits K on q q^T and V on s s^T, so a pair's
    objectives differ: `qqt_h_pbr` and `sst_h_pbr`); format_version and source_grouping must agree.
    """
    k_header, k, k_values = _read_zoo(k_path)
    v_header, v, v_values = _read_zoo(v_path)
    if k.shape != v.shape:
        raise OscarInputError(
            f"{v_path}: {v.shape[0]} layers of {tuple(v.shape[1:])} rotations but {k_path} has "
            f"{k.shape[0]} layers of {tuple(k.shape[1:])}: expected K and V files of the same model"
        )
    for key in ("format_version", "source_grouping"):
        if k_header[key] != v_header[key]:
            raise OscarInputError(f"{v_path}: {key}={v_header[key]!r} but {k_path} has {key}={k_header[key]!r}: "
                                  f"expected the K and V files of one rotation set")
    metadata = {
        "model": None,
        "head_dim": k.shape[-1],
        "layers": k.shape[0],
        "kv_heads": k.shape[1] if k.dim() == 4 else None,
        "k_objective": k_header["objective"],
        "v_objective": v_header["objective"],
        "k_clip": None,
        "v_clip": None,
        "codebook": "uniform",
        "source": f"RotationZoo K={k_path} V={v_path}",
        "source_grouping": k_header["source_grouping"],
        "zoo_format_version": k_header["format_version"],
    }
    return RotationSet(k=k, v=v, metadata=metadata, k_eigenvalues=k_values, v_eigenvalues=v_values)


def zoo_objective(rotation_set: RotationSet, kind: str) -> str | None:
    """The RotationZoo objective of the K or V rotations, as the reference names it."""
    meta = rotation_set.metadata
    return meta.get(f"{kind}_objective", meta.get("objective"))


def zoo_file_names(rotation_set: RotationSet) -> tuple[str, str]:
    """The reference's file names for a pair, `{k,v}_rotation_{objective}.pt`."""
    names = []
    for kind in KINDS:
        objective = zoo_objective(rotation_set, kind)
        if not isinstance(objective, str) or not objective or not all(c.isalnum() or c in "_-." for c in objective):
            raise OscarInputError(f"rotation set: {kind} objective {objective!r}: expected a name to put in the "
                                  f"file name; give --k and --v file paths instead")
        names.append(f"{kind}_rotation_{objective}.pt")
    return names[0], names[1]


def zoo_paths(rotation_set: RotationSet, directory) -> tuple[Path, Path]:
    """The K and V paths in `directory` (created if missing) under the reference's file names."""
    directory = Path(directory)
    k_name, v_name = zoo_file_names(rotation_set)
    if directory.exists() and not directory.is_dir():
        raise OscarInputError(f"{directory}: is a file: expected a directory for the RotationZoo pair")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OscarInputError(f"{directory}: cannot create ({err.strerror or err}): expected a writable directory") \
            from None
    return directory / k_name, directory / v_name


def export_rotation_zoo(rotation_set: RotationSet, k_path, v_path) -> None:
    """Write the official RotationZoo schema back, one file each for K and V, plain dicts and tensors only."""
    rs = rotation_set
    name = f"rotation set for {k_path} and {v_path}"
    if Path(k_path).resolve() == Path(v_path).resolve():
        raise OscarInputError(f"{k_path}: given for both K and V: expected two different files")
    _check_set(rs, name)
    if rs.k_eigenvalues is None or rs.v_eigenvalues is None:
        raise OscarInputError(f"{name}: no eigenvalues: expected K and V eigenvalues, as RotationZoo files carry")
    meta = rs.metadata
    # Per-KV-head rotations need format_version 2; per-layer ones keep the version they came with.
    version = 2 if rs.per_head else meta.get("zoo_format_version", 1)
    for kind, path in (("k", k_path), ("v", v_path)):
        rotation, values = getattr(rs, kind), getattr(rs, f"{kind}_eigenvalues")
        # Clones, so each layer is saved as its own tensor rather than a view into the whole stack.
        data = {"format_version": version, "objective": zoo_objective(rs, kind),
                "source_grouping": meta.get("source_grouping"),
                "layers": {i: {"layer_id": i, "rotation": rotation[i].clone(), "eigenvalues": values[i].clone()}
                           for i in range(rs.layers)}}
        write_atomically(path, lambda temp: torch.save(data, temp))
