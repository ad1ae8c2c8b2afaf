"""What every target's artifact directory shares: staging and atomic replace, file hashes,
manifest.json, and the reference generation an artifact is compared with.

An artifact is written into a temporary sibling directory and renamed into place, so a failed
export never leaves a half-written artifact behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from ..config import OscarConfig, OscarInputError, config_for
from ..calibration.files import ROTATION_MODES, load_rotations
from ..sizes import MAX_CONTEXT, cache_layout

MANIFEST = "manifest.json"
# A manifest lists a few hundred files at most: anything larger is not one (and is not read into memory).
MANIFEST_BYTES = 4 << 20
ROTATION_FILE = "rotations.safetensors"


def manifest_format(target: str) -> str:
    return f"oscar-export/{target}/1"


def rotation_metadata(rotations) -> dict:
    """The metadata of a rotation file (path) or RotationSet; {} for the modes (hadamard, online, none)."""
    if rotations is None or isinstance(rotations, str) and rotations in ROTATION_MODES:
        return {}
    if isinstance(rotations, (str, Path)):
        return load_rotations(rotations).metadata
    return rotations.metadata


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_table(directory: Path) -> dict:
    """{name: {bytes, sha256}} of every file in the directory, recursively (an .mlpackage is a folder)."""
    return {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(directory.rglob("*")) if p.is_file()}


def check_out(out: Path) -> None:
    """out may be new, empty, or a previous artifact holding only its own files (replaced); anything else,
    a user's file beside an artifact included, is refused rather than deleted."""
    if out.is_symlink():
        raise OscarInputError(f"--out {str(out)!r} is a link (to {os.readlink(out)!r}): expected the directory "
                              "itself, which the export replaces; the link is left alone")
    if out.exists():
        if not out.is_dir():
            raise OscarInputError(f"--out {str(out)!r} is a file: expected a new or empty directory, or a previous "
                                  f"export to replace")
        if any(out.iterdir()):
            try:
                listed = set(json.loads(_read_regular(out / MANIFEST, MANIFEST_BYTES))["files"]) | {MANIFEST}
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                raise OscarInputError(f"--out {str(out)!r} exists and is not an oscar-export artifact: expected a "
                                      f"new or empty directory, or a previous export to replace") from None
            # The folders holding listed files are the artifact's; any other entry (a link, an empty folder) is not.
            folders = {str(parent) for name in listed for parent in Path(name).parents}
            present = {str(p.relative_to(out)) for p in out.rglob("*")
                       if p.is_symlink() or not p.is_dir() or str(p.relative_to(out)) not in folders}
            extra = sorted(present - listed)
            if extra:
                shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
                raise OscarInputError(f"--out {str(out)!r} holds entries the artifact did not write ({shown}): move "
                                      f"them, or choose another --out")
    if not out.parent.is_dir():
        raise OscarInputError(f"--out {str(out)!r}: parent directory does not exist")
    probe = out.with_name(f".{out.name}.probe-{os.getpid()}")  # minutes of export must not end in a refusal
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        raise OscarInputError(f"--out {str(out)!r}: cannot write there ({err.strerror or err}): expected a "
                              f"writable directory") from None


def _remove_stale_staging(out: Path) -> None:
    """Staging folders of exports that were killed (their process is gone) are removed."""
    for path in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = path.name[len(out.name) + 2:].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_export_args(out, rotations, device_memory: str) -> int:
    """What every export refuses before loading a model; returns the device memory in bytes."""
    from ..planner import parse_bytes

    check_out(Path(out))
    memory = parse_bytes(device_memory, "--device-memory")
    if isinstance(rotations, str) and rotations == "online":
        raise OscarInputError("--rotations online estimates rotations from each prompt and cannot be exported: "
                              "expected hadamard, none or a rotation file (oscar-export calibrate)")
    return memory


def default_context(shape, max_context: int | None) -> int:
    """--context, or the model's max_position_embeddings capped at 4096."""
    return max_context or min(4096, shape.max_position_embeddings or 4096)


@contextlib.contextmanager
def export_lock(out):
    """Held while an export writes `out`: a second export to the same --out is refused at once, not raced."""
    import fcntl

    out = Path(out)
    lock = out.with_name(f".{out.name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OscarInputError(f"--out {str(out)!r}: another export is writing it now: wait for it to finish, or "
                                  "choose another --out") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:  # not a lock file its holder removed meanwhile
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        os.unlink(lock)
        os.close(fd)


@contextlib.contextmanager
def staged(out: Path):
    """Yields an empty temporary directory next to `out`; on success it replaces `out` atomically."""
    out = Path(out)
    check_out(out)
    _remove_stale_staging(out)
    temp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
        _readable_by_all(temp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(temp, out)
            shutil.rmtree(old)
        else:
            os.replace(temp, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _readable_by_all(directory: Path) -> None:
    """Files as a plain write makes them (0644 under the usual umask): some writers (safetensors, ONNX's
    external data) create 0600 files, which an app bundle or another user could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644) & ~umask)


def write_manifest(directory: Path, manifest: dict) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def save_inputs(temp: Path, tokenizer, rotations, resolved) -> str:
    """The tokenizer and, when one was used, the rotation file; returns the manifest's `rotations` entry."""
    tokenizer.save_pretrained(temp)
    if resolved in ("hadamard", "none"):
        return resolved
    shutil.copy2(rotations, Path(temp) / ROTATION_FILE)
    return ROTATION_FILE


def finish_manifest(temp: Path, target: str, runtime: str, model_name: str, model, shape, rotations: str,
                    config: OscarConfig, max_context: int, max_chunk: int, weights: str, plan: dict,
                    packages: tuple[str, ...], **extra) -> dict:
    """Write manifest.json (what was exported, sha256 of every file written so far) and return it."""
    manifest = {
        "format": manifest_format(target),
        "target": target,
        "runtime": runtime,
        "model": {"source": model_name if model_name == "bundled" else str(Path(model_name).resolve()),
                  "model_type": model.config.model_type, "layers": shape.layers, "q_heads": shape.q_heads,
                  "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab": shape.vocab},
        "rotations": rotations,
        # How the rotations were made (method, text and its hash, tokens, clips, time), from the file itself.
        "rotations_metadata": (load_rotations(Path(temp) / ROTATION_FILE).metadata if rotations == ROTATION_FILE
                               else {"method": rotations}),
        "config": config.to_dict(),
        "max_context": max_context,
        "max_chunk": max_chunk,
        "weights": weights,
        "eos_token_ids": eos_ids(model),
        **extra,
        "files": file_table(temp),
        "plan": plan,
        "versions": {name: importlib.metadata.version(name) for name in packages},
    }
    write_manifest(temp, manifest)
    return manifest


ROTATIONS = ("hadamard", "none", ROTATION_FILE)


def load_manifest(directory, verify: bool = True) -> dict:
    """The artifact's manifest. With `verify` (what run and parity do) every value a runner relies on is
    checked, and every listed file's size and sha256, before anything
    native reads them: a damaged or edited artifact is an error naming the file, never a wrong answer."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(_read_regular(path, MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else err
        raise OscarInputError(f"--artifact {str(directory)!r}: no readable {MANIFEST} ({reason}): "
                              "expected a directory written by 'oscar-export --target ...'") from None
    found = manifest.get("target") if isinstance(manifest, dict) else None
    if not isinstance(found, str) or manifest.get("format") != manifest_format(found):
        raise OscarInputError(f"--artifact {str(directory)!r}: {MANIFEST} is not format 'oscar-export/<target>/1'")
    if verify:
        check_manifest(directory, manifest)
        verify_files(directory, manifest)
    return manifest


def _read_regular(path: Path, limit: int) -> str:
    """The text of `path`, which must be a regular file (not a link, FIFO or device) of at most `limit` bytes."""
    stat = path.lstat()
    if not os.path.isfile(path) or path.is_symlink():
        raise OSError(f"{path.name} is not a regular file")
    if stat.st_size > limit:
        raise OSError(f"{path.name} is {stat.st_size} bytes, more than a manifest's {limit}")
    with open(path, "rb") as f:
        return f.read(limit + 1).decode("utf-8")


# A bound on the model's counts in a manifest (layers, heads, head_dim, vocabulary): far past any model, and it keeps a
# hand-edited value from becoming an allocation.
MODEL_FIELD_MAX = 1 << 24


def _is_int(value) -> bool:
    return type(value) is int


def check_manifest(directory, manifest: dict) -> None:
    """The values the runners use, each in range; an error names the field."""
    where = f"--artifact {str(directory)!r}: {MANIFEST}"

    def require(ok: bool, field: str, expected: str) -> None:
        if not ok:
            raise OscarInputError(f"{where}: {field}={manifest.get(field)!r}: expected {expected}; re-export "
                                  f"the artifact")

    config = manifest.get("config")
    require(isinstance(config, dict), "config", "the cache format as an object")
    try:
        OscarConfig.from_dict(config)
    except (OscarInputError, TypeError) as err:
        raise OscarInputError(f"{where}: config: {err}; re-export the artifact") from None
    for window in ("sink", "recent"):
        if not config.get(window, 0) <= MAX_CONTEXT:
            raise OscarInputError(f"{where}: config: {window}={config[window]!r}: expected at most {MAX_CONTEXT} "
                                  "tokens; re-export the artifact")
    max_context = manifest.get("max_context")
    require(_is_int(max_context) and 1 <= max_context <= MAX_CONTEXT, "max_context", f"tokens in 1..{MAX_CONTEXT}")
    max_chunk = manifest.get("max_chunk")
    require(_is_int(max_chunk) and 1 <= max_chunk <= max_context, "max_chunk", f"tokens in 1..{max_context}")
    model = manifest.get("model")
    require(isinstance(model, dict) and isinstance(model.get("source"), str), "model",
            "{source, model_type, layers, q_heads, kv_heads, head_dim, vocab}")
    for field in ("layers", "q_heads", "kv_heads", "head_dim", "vocab"):
        value = model.get(field)
        if not (_is_int(value) and 1 <= value <= MODEL_FIELD_MAX):
            raise OscarInputError(f"{where}: model.{field}={value!r}: expected a count in 1..{MODEL_FIELD_MAX}; "
                                  "re-export the artifact")
    eos = manifest.get("eos_token_ids")
    require(isinstance(eos, list) and bool(eos) and all(_is_int(i) and 0 <= i < model["vocab"] for i in eos),
            "eos_token_ids", f"a non-empty list of token ids below the vocabulary's {model['vocab']}")
    require(manifest.get("rotations") in ROTATIONS, "rotations", f"one of {list(ROTATIONS)}")
    files = manifest.get("files")
    require(isinstance(files, dict) and bool(files), "files", "{name: {bytes, sha256}} of the artifact's files")
    for name, meta in files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise OscarInputError(f"{where}: file name {name!r}: expected a path inside the artifact")
        ok = (isinstance(meta, dict) and _is_int(meta.get("bytes")) and meta["bytes"] >= 0
              and isinstance(meta.get("sha256"), str) and len(meta["sha256"]) == 64
              and all(c in "0123456789abcdef" for c in meta["sha256"]))
        if not ok:
            raise OscarInputError(f"{where}: files[{name!r}]={meta!r}: expected {{bytes, sha256}}")


def manifest_cache_layout(manifest: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """sizes.cache_layout of a verified manifest's config, model shape and context."""
    model = manifest["model"]
    return cache_layout(OscarConfig.from_dict(manifest["config"]), model["layers"], model["kv_heads"],
                        model["head_dim"], manifest["max_context"])


def check_program(directory, manifest: dict, program: str, layout: dict, vocab: int | None,
                  max_chunk: int | None) -> None:
    """The manifest describes the program: its config, max_context and model shape give the cache buffers the
    program holds (name -> (shape, element type), as the program declares them), its vocab the logits' width,
    its max_chunk the longest chunk the program takes (None where the program does not bound it)."""
    model = manifest["model"]
    where = f"--artifact {str(directory)!r}: {MANIFEST} does not describe {program}"
    expected = {name: (shape, dtype) for name, shape, dtype in manifest_cache_layout(manifest)}
    if list(expected) != list(layout):
        raise OscarInputError(f"{where}: its model.layers={model['layers']} give {len(expected)} cache buffers, the "
                              f"program holds {len(layout)}; re-export the artifact")
    for name, (shape, dtype) in expected.items():
        found = (tuple(layout[name][0]), layout[name][1])
        if found != (shape, dtype):
            raise OscarInputError(f"{where}: its config, max_context and model give {name} {shape} {dtype}, the "
                                  f"program holds {found[0]} {found[1]}; re-export the artifact")
    if vocab is not None and vocab != model["vocab"]:
        raise OscarInputError(f"{where}: model.vocab={model['vocab']}, the program's logits have {vocab}; "
                              "re-export the artifact")
    if max_chunk is not None and max_chunk != manifest["max_chunk"]:
        raise OscarInputError(f"{where}: max_chunk={manifest['max_chunk']}, the program takes chunks of at most "
                              f"{max_chunk} tokens; re-export the artifact")


_VERIFIED: set = set()  # (path, size, mtime_ns, sha256) already hashed in this process


def verify_files(directory, manifest: dict) -> None:
    """Each listed file exists with the manifest's size and sha256."""
    directory = Path(directory)
    inside = directory.resolve()
    for name, meta in manifest["files"].items():
        path = directory / name
        try:
            stat = path.lstat()
        except OSError:
            raise OscarInputError(f"--artifact {str(directory)!r}: {name} is missing: the artifact is incomplete; "
                                  f"re-export it") from None
        if path.is_symlink() or not path.resolve().is_relative_to(inside):
            raise OscarInputError(f"--artifact {str(directory)!r}: {name} is a link, or reached through one: "
                                  "expected the artifact's own regular file; re-export it")
        if not path.is_file() or stat.st_size != meta["bytes"]:
            raise OscarInputError(f"--artifact {str(directory)!r}: {name} is {stat.st_size} bytes, the manifest "
                                  f"says {meta['bytes']}: the artifact is damaged; re-export it")
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, meta["sha256"])
        if key in _VERIFIED:
            continue
        if sha256(path) != meta["sha256"]:
            raise OscarInputError(f"--artifact {str(directory)!r}: {name} does not match its sha256 in {MANIFEST}: "
                                  f"the artifact is damaged or was edited; re-export it")
        _VERIFIED.add(key)


def eos_ids(model) -> list[int]:
    """The tokens that end a generation (generation_config.json's, else config.json's): a runner stops at them."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not ids:
        raise OscarInputError("the model names no end-of-sequence token (eos_token_id in generation_config.json or "
                              "config.json): expected one, or every generation would run to the end of the context")
    return ids


def artifact_tokenizer(directory):
    """The tokenizer an artifact carries; a damaged one is an error naming the artifact."""
    from ..models import load_tokenizer

    return load_tokenizer(directory, f"--artifact {str(directory)!r}")


def prompt_ids(tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    if not ids:
        raise OscarInputError("--prompt is empty after tokenization: expected some text")
    return ids


def eager_module(directory, manifest: dict):
    """The eager graph (graph.OscarCausalLM) of the artifact's source model, config and rotations."""
    from ..hf_cache import resolve_rotations
    from ..models import load_model
    from .graph import OscarCausalLM

    model, _ = load_model(manifest["model"]["source"])
    rotations = manifest["rotations"]
    resolved = resolve_rotations(str(Path(directory) / rotations) if rotations == ROTATION_FILE else rotations, model)
    return OscarCausalLM(model, config_for(rotation_metadata(resolved), **manifest["config"]), resolved).eval()


def eager_trace(module, manifest: dict, ids: list[int], steps: int, device="cpu", forced=None) -> dict:
    """Greedy run of the eager graph (graph.OscarCausalLM, in-place cache) at the artifact's context, chunk and
    EOS ids: the reference of parity.

    Returns the greedy `tokens`, the logits of each step (the prefill's last position, then each
    decode step's) and the packed body `codes` by cache name. forced: tokens fed instead of its own
    picks, as GreedyLM.trace takes them.
    """
    max_context, max_chunk, eos = manifest["max_context"], manifest["max_chunk"], manifest["eos_token_ids"]
    if forced is not None:
        steps = min(steps, len(forced))
    cache = [t.to(device) for t in module.new_cache(max_context)]
    length, tokens, logits = torch.zeros(1, dtype=torch.int64, device=device), [], []
    with torch.no_grad():
        for start in range(0, len(ids), max_chunk):
            chunk = ids[start:start + max_chunk]
            step = module(torch.tensor([chunk], device=device), length, *cache)
            length += len(chunk)
        for _ in range(steps):
            logits.append(step[0, -1].float().cpu().numpy().copy())
            tokens.append(int(step[0, -1].argmax()))
            fed = tokens[-1] if forced is None else int(forced[len(tokens) - 1])
            if fed in eos or len(tokens) == steps:
                break
            step = module(torch.tensor([[fed]], device=device), length, *cache)
            length += 1
    names = [name for name, _, _ in module.cache_spec(max_context)]
    return {"tokens": tokens, "logits": logits, "forced": forced is not None,
            "codes": {name: t.cpu().numpy() for name, t in zip(names, cache) if name.endswith("_codes")}}


class GreedyLM:
    """Greedy generation for a runtime's runner, which provides step(ids) -> the last position's logits
    (advancing its cache by len(ids) tokens) and max_chunk, the longest chunk one step takes."""

    max_chunk: int

    def step(self, ids) -> np.ndarray:
        raise NotImplementedError

    def fill_synthetic(self, length: int, config: OscarConfig, rng: np.random.Generator) -> None:
        """A valid cache state of `length` tokens in place of this one, before any step: fp16 windows of random
        rows, a packed body (past sink + recent) of random rows quantized by the reference codec. Decode cost does
        not depend on the values, and prefilling a long context takes minutes to hours on a laptop CPU. One KV
        head at a time, so the state costs no more memory than the buffers it fills.
        """
        from ..codec import quantize
        from ..ops.attention import BUFFER_SCALE_DTYPES

        cache = self.writable_cache()
        if self.length:
            raise OscarInputError("fill_synthetic: expected a fresh runner, before any step")
        rows = max(length - config.sink - config.recent, 0)
        expected = np.dtype(str(BUFFER_SCALE_DTYPES[config.scale_dtype]).removeprefix("torch."))
        for name, array in cache.items():
            if name.endswith(("_scale", "_zero")) and array.dtype != expected:
                raise OscarInputError(f"{name} is {array.dtype}: expected {expected} for "
                                      f"scale_dtype={config.scale_dtype!r}, the config the state is written in")
        if not 0 < length <= self.max_context:
            raise OscarInputError(f"synthetic length {length}: expected 0 < length <= max_context = "
                                  f"{self.max_context}")
        for name, array in cache.items():
            layer, buffer = name.split(".")
            kind, region = buffer.split("_")
            if region in ("sink", "recent"):
                array[...] = rng.standard_normal(array.shape, dtype=np.float32)
            elif region == "codes" and rows:
                head_dim = cache[f"{layer}.{kind}_sink"].shape[2]
                for head in range(array.shape[0]):
                    x = torch.from_numpy(rng.standard_normal((rows, head_dim), dtype=np.float32))
                    one = config.layer(int(layer.removeprefix("layer")))  # its own K width and clip
                    packed = quantize(x, one.bits(kind), one.cluster_dim, one.clip(kind), None, one.scale_dtype)
                    for part, values in zip(("codes", "scale", "zero"), packed):
                        if values.dtype == torch.float8_e4m3fn:  # the buffers hold its bits
                            values = values.view(torch.uint8)
                        cache[f"{layer}.{kind}_{part}"][head, :rows] = values.numpy()
        self.length = length

    def writable_cache(self) -> dict[str, np.ndarray]:
        """The buffers the runtime reads the cache from, as arrays written in place, by layer{i}.{name}."""
        raise OscarInputError(f"{type(self).__name__} cannot write a synthetic cache state: expected a laptop "
                              "or android artifact")

    def prefill(self, ids) -> np.ndarray:
        ids = list(ids)
        if not ids:
            raise OscarInputError("prompt is empty: expected at least one token")
        for start in range(0, len(ids), self.max_chunk):
            logits = self.step(ids[start:start + self.max_chunk])
        return logits

    def trace(self, ids, steps: int, eos_token_ids=(), forced=None) -> tuple[list[int], list[np.ndarray]]:
        """Greedy tokens after the prompt, stopping after an EOS token or `steps` tokens, and the logits
        each came from: the prefill's, then each decode step's. forced: the tokens to feed instead of
        its own (teacher forcing; `steps` is then at most their count), so every step reads the prefix
        another run read, while the returned tokens stay this runtime's own picks."""
        if forced is not None:
            steps = min(steps, len(forced))
        logits, tokens, seen = self.prefill(ids), [], []
        while len(tokens) < steps:
            seen.append(logits)
            tokens.append(int(np.argmax(logits)))
            fed = tokens[-1] if forced is None else int(forced[len(tokens) - 1])
            if fed in eos_token_ids or len(tokens) == steps:
                break
            logits = self.step([fed])
        return tokens, seen

    def generate(self, ids, max_new_tokens: int, eos_token_ids=()) -> list[int]:
        return self.trace(ids, max_new_tokens, eos_token_ids)[0]

    def cache_arrays(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def body_codes(self) -> dict[str, np.ndarray]:
        """The packed body codes (uint8, format.md layout) by cache name, layer{i}.k_codes ...: what parity compares."""
        return {name: array.copy() for name, array in self.cache_arrays().items() if name.endswith("_codes")}
