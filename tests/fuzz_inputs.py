"""A seeded fuzz harness for the files users hand us: rotation files, RotationZoo pickles, artifact
manifests (damaged, and edited to disagree with the program they describe), artifact files (weights, tokenizer,
op library, program headers; also damaged with the manifest re-hashed to vouch for them), parity traces,
checkpoints, --out directories holding a user's entries, and random calls into the native core's C API.

Every case ends in one of:
- "refused": a one-line OscarInputError (the expected answer to a damaged input);
- "accepted": the input loaded (fine where the mutation kept it valid);
- "traceback": any other exception (a bug: the user sees a stack trace);
- "crash": the process died on a signal (native code read what it should not have);
- "silent": a mutation that must be refused was accepted (a wrong answer waiting to happen);
- "lost": a refused export removed an entry of the user's.

tests/test_fuzz.py runs a bounded number of cases in CI; many more on demand:
    .venv/bin/python tests/fuzz_inputs.py --cases 2000 --seed 1 [--artifact DIR]
(DIR: an artifact of any target, exported from the bundled model; without it a laptop one is exported first).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from oscar_export.config import OscarInputError

OUTCOMES = ("refused", "accepted", "traceback", "crash", "silent", "lost")
BAD = ("traceback", "crash", "silent", "lost")


def outcome(load, must_refuse: bool) -> str:
    try:
        load()
    except OscarInputError as err:
        return "refused" if "\n" not in str(err) else "traceback"
    except Exception:  # noqa: BLE001 - what the harness counts
        return "traceback"
    return "silent" if must_refuse else "accepted"


def mutate_bytes(rng: np.random.Generator, data: bytes) -> bytes:
    """Flip, truncate, extend or overwrite a region: the damage a disk, a download or an editor does."""
    buf = bytearray(data)
    kind = rng.integers(4)
    if kind == 0 and buf:
        for i in rng.integers(0, len(buf), int(rng.integers(1, 9))):
            buf[i] ^= int(rng.integers(1, 256))
    elif kind == 1:
        del buf[int(rng.integers(0, max(len(buf), 1))):]
    elif kind == 2:
        buf += rng.bytes(int(rng.integers(1, 64)))
    elif buf:
        start = int(rng.integers(0, len(buf)))
        buf[start:start + 16] = rng.bytes(16)[: len(buf[start:start + 16])]
    return bytes(buf)


# -- rotation files ---------------------------------------------------------------------------------


def _rotation_sources(tmp: Path) -> tuple[Path, Path, Path]:
    from oscar_export.calibration.files import RotationSet, export_rotation_zoo, save_rotations

    q = torch.linalg.qr(torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0)))[0].contiguous()
    rs = RotationSet(k=q, v=q.flip(-1).contiguous(), k_eigenvalues=torch.rand(2, 32), v_eigenvalues=torch.rand(2, 32),
                     metadata={"k_clip": 0.9, "v_clip": 0.9, "codebook": "uniform", "k_bits": 2, "v_bits": 2,
                               "cluster_dim": 32, "k_objective": "qqt_h_pbr", "v_objective": "sst_h_pbr"})
    ours, k, v = tmp / "rot.safetensors", tmp / "k.pt", tmp / "v.pt"
    save_rotations(ours, rs)
    export_rotation_zoo(rs, k, v)
    return ours, k, v


METADATA_VALUES = [5.0, -1, "abc", float("nan"), None, [], {}, "magic", 7, 48, 0.5, True, 1e308]


def fuzz_rotation_files(rng: np.random.Generator, cases: int, tmp: Path) -> Counter:
    from oscar_export.calibration.files import import_rotation_zoo, load_rotations

    ours, k, v = _rotation_sources(tmp)
    counts = Counter()
    for i in range(cases):
        case = tmp / f"case{i}"
        kind = rng.integers(3)
        if kind == 0:  # our safetensors file, bytes damaged
            case.write_bytes(mutate_bytes(rng, ours.read_bytes()))
            counts[outcome(lambda: load_rotations(case), must_refuse=False)] += 1
        elif kind == 1:  # our file with one metadata field set to an arbitrary value
            from safetensors import safe_open
            from safetensors.torch import save_file

            with safe_open(str(ours), framework="pt") as f:
                header, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
            meta = json.loads(header["oscar"])
            key = str(rng.choice(["k_clip", "v_clip", "codebook", "k_bits", "cluster_dim", "layers"]))
            value = METADATA_VALUES[int(rng.integers(len(METADATA_VALUES)))]
            meta[key] = value
            text = json.dumps(meta)  # NaN is written as JSON allows (the reader must refuse it)
            save_file(tensors, str(case), metadata={**header, "oscar": text})
            # None leaves a field unset; 0.5 is a valid clip; everything else in METADATA_VALUES is invalid there.
            valid = {"k_clip": (0.5, None), "v_clip": (0.5, None), "codebook": (None,), "k_bits": (None,),
                     "cluster_dim": (None,), "layers": ()}[key]
            must_refuse = not any(value is v or (type(value) is type(v) and value == v) for v in valid)
            counts[outcome(lambda: load_rotations(case), must_refuse=must_refuse)] += 1
        else:  # a RotationZoo pickle damaged
            case.write_bytes(mutate_bytes(rng, k.read_bytes()))
            counts[outcome(lambda: import_rotation_zoo(case, v), must_refuse=False)] += 1
    return counts


# -- artifacts --------------------------------------------------------------------------------------


MANIFEST_FIELDS = {
    "config": [{"k_bits": 7}, {"cluster_dim": 48}, {"k_clip": 2.0}, "x", None, {"unknown": 1}],
    "max_context": [0, -1, 10**12, "512", 1.5, None],
    "max_chunk": [0, -1, "512", 10**9, None],
    "eos_token_ids": ["0", [-1], [1.5], None],
    "rotations": ["../../etc/passwd", 3, None],
    "files": [{}, {"../x": {"bytes": 1, "sha256": "0" * 64}}, {"model.onnx": {"bytes": -1, "sha256": "0" * 64}},
              {"model.onnx": {"bytes": 1, "sha256": "zz"}}, [], None],
    "format": ["oscar-export/laptop/2", 1, None],
}


def fuzz_manifests(rng: np.random.Generator, cases: int, artifact: Path, tmp: Path) -> Counter:
    from oscar_export.export.artifact import MANIFEST, load_manifest

    base = json.loads((artifact / MANIFEST).read_text())
    counts = Counter()
    work = tmp / "manifest_case"
    shutil.copytree(artifact, work)
    for _ in range(cases):
        manifest = json.loads(json.dumps(base))
        key = str(rng.choice(list(MANIFEST_FIELDS)))
        values = MANIFEST_FIELDS[key]
        manifest[key] = values[int(rng.integers(len(values)))]
        (work / MANIFEST).write_text(json.dumps(manifest))
        counts[outcome(lambda: load_manifest(work), must_refuse=True)] += 1
    return counts


def fuzz_artifact_files(rng: np.random.Generator, cases: int, artifact: Path, tmp: Path) -> Counter:
    """A listed file damaged: refused by its size or sha256 before anything native reads it."""
    from oscar_export.export.artifact import MANIFEST, load_manifest

    names = sorted(json.loads((artifact / MANIFEST).read_text())["files"])
    counts = Counter()
    work = tmp / "file_case"
    shutil.copytree(artifact, work)
    for _ in range(cases):
        name = names[int(rng.integers(len(names)))]
        original = (artifact / name).read_bytes()
        damaged = mutate_bytes(rng, original)
        (work / name).write_bytes(damaged)
        counts[outcome(lambda: load_manifest(work), must_refuse=damaged != original)] += 1
        (work / name).write_bytes(original)
    return counts


def hostile_manifest_files(artifact: Path, tmp: Path) -> Counter:
    """Every way of handing over something that is not the artifact's own regular file: the manifest as a FIFO
    (reading it would block), a link to /dev/zero (it never ends), 200,000 nested lists, 5 MB of padding, a link
    to a copy outside the artifact; a listed file replaced by a link to an identical copy outside it."""
    import os

    from oscar_export.export.artifact import MANIFEST, load_manifest

    counts = Counter()
    manifest = (artifact / MANIFEST).read_text()
    outside = tmp / "outside"
    outside.mkdir(exist_ok=True)

    def case(name: str, make) -> None:
        work = tmp / f"hostile_{name}"
        shutil.copytree(artifact, work)
        (work / MANIFEST).unlink()
        make(work)
        counts[outcome(lambda: load_manifest(work), must_refuse=True)] += 1

    case("fifo", lambda w: os.mkfifo(w / MANIFEST))
    case("zero", lambda w: (w / MANIFEST).symlink_to("/dev/zero"))
    case("deep", lambda w: (w / MANIFEST).write_text("[" * 200_000))
    case("large", lambda w: (w / MANIFEST).write_text(manifest[:-1] + " " * (5 << 20) + "}"))
    (outside / MANIFEST).write_text(manifest)
    case("link", lambda w: (w / MANIFEST).symlink_to(outside / MANIFEST))
    member = sorted(json.loads(manifest)["files"])[0]

    def member_link(work: Path) -> None:
        (work / MANIFEST).write_text(manifest)
        shutil.copy2(artifact / member, outside / "member")
        (work / member).unlink()
        (work / member).symlink_to(outside / "member")

    case("member", member_link)
    return counts


def field_edits(manifest: dict) -> dict:
    """What each edit does to a manifest: every one leaves it valid JSON of the right shape, and makes it disagree
    with the program it describes (the cache layout, logits, chunk or runtime) or leave a field's range."""
    model, config, layers = manifest["model"], manifest["config"], manifest["model"]["layers"]

    def edit(path: str, value):
        def apply(m: dict) -> None:
            *parents, last = path.split(".")
            for key in parents:
                m = m[key]
            m[last] = value(m.get(last)) if callable(value) else value
        return apply

    edits = {
        "max_context +1": edit("max_context", lambda v: v + 1), "max_context 65536": edit("max_context", 65536),
        "k_bits": edit("config.k_bits", 4 if config["k_bits"] != 4 else 2),
        "v_bits": edit("config.v_bits", 3 if config["v_bits"] != 3 else 2),
        "cluster_dim": edit("config.cluster_dim", lambda v: v // 2),
        "sink 0": edit("config.sink", 0), "sink +1": edit("config.sink", lambda v: v + 1),
        "recent 10**12": edit("config.recent", 10**12), "recent -1": edit("config.recent", -1),
        "scale_dtype": edit("config.scale_dtype", "float8_e4m3fn" if config["scale_dtype"] == "float16"
                            else "float16"),
        "k_bits_by_layer": edit("config.k_bits_by_layer", [4 if config["k_bits"] != 4 else 3] * layers),
        "layers 0": edit("model.layers", 0), "layers +1": edit("model.layers", lambda v: v + 1),
        "head_dim '64'": edit("model.head_dim", str(model["head_dim"])),
        "head_dim x2": edit("model.head_dim", lambda v: v * 2), "kv_heads +1": edit("model.kv_heads", lambda v: v + 1),
        "vocab 10**12": edit("model.vocab", 10**12), "vocab +1": edit("model.vocab", lambda v: v + 1),
        "no model": lambda m: m.pop("model"),
        "eos []": edit("eos_token_ids", []), "eos 10**20": edit("eos_token_ids", [10**20]),
        "eos vocab": edit("eos_token_ids", [model["vocab"]]), "runtime": edit("runtime", "bogus"),
        "max_chunk > context": edit("max_chunk", lambda v: manifest["max_context"] + 1),
        "target": edit("target", "laptop" if manifest["target"] != "laptop" else "android"),
    }
    if manifest["target"] != "laptop":  # ONNX Runtime takes chunks of any length; the other programs are bounded
        edits["max_chunk -1"] = edit("max_chunk", lambda v: v - 1)
    return edits


def manifest_field_edits(artifact: Path, tmp: Path) -> Counter:
    """Each field no hash covers edited (field_edits): opening the artifact, as run and parity do, refuses it."""
    from oscar_export.export.artifact import MANIFEST
    from oscar_export.run import open_artifact

    base = json.loads((artifact / MANIFEST).read_text())
    counts = Counter()
    work = tmp / "field_case"
    shutil.copytree(artifact, work)
    for apply in field_edits(base).values():
        manifest = json.loads(json.dumps(base))
        apply(manifest)
        (work / MANIFEST).write_text(json.dumps(manifest))
        counts[outcome(lambda: open_artifact(work), must_refuse=True)] += 1
    return counts


def hostile_traces(artifact: Path, tmp: Path) -> Counter:
    """parity --against files that are well-formed traces of this artifact with values no run can give."""
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    from oscar_export.export.artifact import MANIFEST
    from oscar_export.parity import load_trace, save_trace

    manifest = json.loads((artifact / MANIFEST).read_text())
    genuine = tmp / "trace.safetensors"
    save_trace(genuine, artifact, [1, 2, 3, 4], 3)
    tensors = load_file(str(genuine))
    with safe_open(str(genuine), "np") as f:
        metadata = f.metadata()
    codes = next(name for name in tensors if name.startswith("codes."))
    edits = {
        "prompt id 10**9": ("prompt", np.array([1, 10**9], np.int64)), "prompt id -5": ("prompt", np.array([-5], np.int64)),
        "empty prompt": ("prompt", np.zeros(0, np.int64)), "prompt as floats": ("prompt", np.array([1.0, 2.0])),
        "token id 10**9": ("tokens", np.array([10**9], np.int64)), "logits columns": ("logits", tensors["logits"][:, :-1]),
        "logits float64": ("logits", tensors["logits"].astype(np.float64)),
        "codes shape": (codes, tensors[codes][..., :-1]), "codes of no cache": ("codes.layer99.k_codes", tensors[codes]),
        "steps 0": ("steps", "0"), "steps 10**8": ("steps", str(10**8)),
        "prompt past the context": ("prompt", np.ones(manifest["max_context"], np.int64)),
    }
    counts = Counter()
    for i, (name, value) in enumerate(edits.values()):
        case, fields, meta = tmp / f"trace{i}.safetensors", dict(tensors), dict(metadata)
        if name == "steps":
            meta["steps"] = value
        else:
            fields[name] = value
        save_file(fields, str(case), metadata=meta)
        counts[outcome(lambda: load_trace(case, manifest), must_refuse=True)] += 1
    return counts


def hostile_checkpoints(tmp: Path) -> Counter:
    """--model directories that are not a usable checkpoint: each refused by the loader of calibration, android and
    ios (the whole model) and by a laptop export (which streams a safetensors checkpoint) before any work."""
    from oscar_export.export.artifact import eos_ids
    from oscar_export.export.pipeline import export_artifact
    from oscar_export.models import BUNDLED_MODEL_DIR, load_model
    from oscar_export.targets import get

    def config(**changes):
        def apply(d: Path) -> None:
            cfg = json.loads((d / "config.json").read_text())
            cfg.update(changes)
            (d / "config.json").write_text(json.dumps(cfg))
        return apply

    def no_eos(d: Path) -> None:
        config(eos_token_id=None)(d)
        (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0}))

    weights = BUNDLED_MODEL_DIR / "model.safetensors"
    edits = {
        "no tokenizer": lambda d: [p.unlink() for p in d.glob("tokenizer*")],
        "junk weights": lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 1000),
        "truncated weights": lambda d: (d / "model.safetensors").write_bytes(weights.read_bytes()[:100_000]),
        "no weights": lambda d: (d / "model.safetensors").unlink(),
        "heads 0": config(num_attention_heads=0), "hidden '64'": config(hidden_size="64"),
        "layers -1": config(num_hidden_layers=-1), "vocab below the tokenizer's": config(vocab_size=1000),
        "config not JSON": lambda d: (d / "config.json").write_text("{"),
        "config a list": lambda d: (d / "config.json").write_text("[]"),
        "no end of sequence": no_eos,
    }
    counts = Counter()
    for i, change in enumerate(edits.values()):
        work = tmp / f"checkpoint{i}"
        shutil.copytree(BUNDLED_MODEL_DIR, work)
        change(work)
        counts[outcome(lambda: eos_ids(load_model(str(work))[0]), must_refuse=True)] += 1
        counts[outcome(lambda: export_artifact(get("laptop"), str(work), tmp / "checkpoint_out", "hadamard", 64,
                                               float_weights=True), must_refuse=True)] += 1
    return counts


def out_entries(artifact: Path, tmp: Path) -> Counter:
    """--out holding what the user put there (a link, an empty folder tree), a link itself, or being written by
    another export: refused before the model loads, and every entry of the user's still there afterwards."""
    from oscar_export.export.artifact import export_lock
    from oscar_export.export.pipeline import export_artifact
    from oscar_export.targets import get

    counts = Counter()
    important = tmp / "important"
    important.mkdir(exist_ok=True)

    def case(name: str, make, out_of=lambda work: work, locked: bool = False) -> None:
        work = tmp / f"out_{name}"
        shutil.copytree(artifact, work)
        kept = make(work)
        out = out_of(work)

        def export():
            export_artifact(get("laptop"), "bundled", out, "hadamard", 64, float_weights=True)

        if locked:
            with export_lock(out):
                result = outcome(export, must_refuse=True)
        else:
            result = outcome(export, must_refuse=True)
        counts["lost" if not all(p.is_symlink() or p.exists() for p in kept) else result] += 1

    def user_link(work: Path) -> list[Path]:
        (work / "mylink").symlink_to(important)
        return [work / "mylink", important]

    def empty_tree(work: Path) -> list[Path]:
        (work / "notes" / "drafts").mkdir(parents=True)
        return [work / "notes" / "drafts"]

    def link_out(work: Path) -> list[Path]:
        (tmp / "link_to_artifact").symlink_to(work)
        return [tmp / "link_to_artifact", work / "manifest.json"]

    case("link", user_link)
    case("tree", empty_tree)
    case("out_link", link_out, out_of=lambda work: tmp / "link_to_artifact")
    case("locked", lambda work: [work / "manifest.json"], locked=True)
    return counts


NATIVE_CASE = """
import hashlib, json, sys
from pathlib import Path
from oscar_export.config import OscarInputError
from oscar_export.export.artifact import MANIFEST
work, name = Path(sys.argv[1]), sys.argv[2]
manifest = json.loads((work / MANIFEST).read_text())
data = (work / name).read_bytes()
manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
(work / MANIFEST).write_text(json.dumps(manifest))  # the manifest vouches for the damage: the loaders see it
try:
    from oscar_export.run import open_artifact, run_artifact
    _, _, target = open_artifact(work)
    for runtime in target.runtimes:
        if runtime not in target.unavailable_runtimes():
            run_artifact(work, "The", 2, runtime=runtime, threads=1)
except OscarInputError as err:
    print("refused" if "\\n" not in str(err) else "traceback")
except Exception:
    print("traceback")
else:
    print("accepted")
"""

# Where damage reaches a loader's parsing rather than only the weights' values: each target's programs, op
# library and tokenizer (the ios model's description, weights and package manifest).
PARSED_FILES = ("model.onnx", "model_fallback.onnx", "liboscar_ort.so", "model.pte", "liboscar_executorch.so",
                "model.mlpackage/Data/com.apple.CoreML/model.mlmodel",
                "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin", "model.mlpackage/Manifest.json",
                "tokenizer.json", "tokenizer_config.json")


def fuzz_native_loads(rng: np.random.Generator, cases: int, artifact: Path, tmp: Path) -> Counter:
    """The artifact's parsed files damaged, with a manifest re-hashed to vouch for them, run on every runtime of
    its target in a child process, so a crash is counted rather than fatal."""
    counts = Counter()
    names = [n for n in PARSED_FILES if (artifact / n).is_file()]
    for i in range(cases):
        work = tmp / f"native{i}"
        shutil.copytree(artifact, work)
        name = names[int(rng.integers(len(names)))]
        data = (work / name).read_bytes()
        (work / name).write_bytes(mutate_bytes(rng, data[:4096]) + data[4096:])  # the header region
        proc = subprocess.run([sys.executable, "-c", NATIVE_CASE, str(work), name], capture_output=True, text=True,
                              timeout=300)
        counts["crash" if proc.returncode < 0 else (proc.stdout.strip().splitlines() or ["traceback"])[-1]] += 1
        shutil.rmtree(work)
    return counts


C_API_CASES = """
import ctypes, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from native_core_api import OscarAttentionConfig
lib = ctypes.CDLL(sys.argv[2])
rng, counts = np.random.default_rng(int(sys.argv[3])), {"refused": 0, "accepted": 0}
for case in range(int(sys.argv[4])):
    p_bad = 0.0 if case % 2 else 0.15  # every other call is valid, so the kernels run too
    pick = lambda good, bad: int(rng.choice(good)) if rng.random() >= p_bad else int(rng.integers(*bad))
    choose = lambda good, bad: float(rng.choice(good)) if rng.random() >= p_bad else float(rng.choice(bad))
    kb, vb, cd = pick([2, 3, 4], (-1, 9)), pick([2, 3, 4], (-1, 9)), pick([32, 64, 128], (-1, 200))
    cfg = OscarAttentionConfig(kb, vb, cd, pick([0, 2, 4], (-3, 40)), pick([0, 3, 8], (-3, 40)),
                               choose([1.0, 0.9], [np.nan, 2.0]), choose([1.0, 0.8], [-1.0, np.inf]),
                               choose([0.125], [np.inf, 0.0]), pick([1, 2], (-2, 100)), pick([0, 1, 2, 3], (-2, 9)),
                               pick([0, 1], (-2, 5)))
    hkv = pick([1, 2], (-1, 5)); hq = hkv * pick([1, 2, 4], (0, 3)); t = pick([1, 5], (-1, 30))
    d = pick([cd * int(rng.choice([1, 2])) if cd in (32, 64) else 128], (-1, 300))
    context = int(rng.integers(1, 41))  # valid capacities follow the placement rule for some context
    s_, w_ = max(cfg.sink, 0), max(cfg.recent, 0)
    valid_caps = [min(s_, context), min(w_, max(context - s_, 0)), max(context - s_ - w_, 0)]
    caps = [pick([c], (-2, 64)) for c in valid_caps]
    dims = [hq, hkv, t, d, *caps]
    groups = hkv * caps[2] * (d // cd if cd > 0 else 0)
    shapes = [hq*t*d, hkv*t*d, hkv*t*d, hkv*caps[0]*d, hkv*caps[0]*d, hkv*caps[1]*d, hkv*caps[1]*d,
              hkv*caps[2]*d*max(kb, 0)//8, groups, groups, hkv*caps[2]*d*max(vb, 0)//8, groups, groups,
              2**max(min(kb, 8), 0), 2**max(min(vb, 8), 0), hkv*d*d if cfg.k_rounding == 1 else 0, hq*t*d]
    shapes = [max(n, 0) if rng.random() >= p_bad else int(rng.integers(0, 64)) for n in shapes]
    kinds = [np.float32, np.uint16, np.uint16] + [np.uint16] * 4 + [np.uint8, np.uint16, np.uint16] * 2
    kinds += [np.float32] * 4
    # fp16 buffers hold real fp16 values; codes any byte; levels ascending (as a valid call needs).
    buffers = [(rng.standard_normal(n) * 3).astype(np.float16).view(np.uint16) if k == np.uint16
               else rng.integers(0, 256, n, np.uint8) if k == np.uint8 else (rng.standard_normal(n) * 3).astype(k)
               for n, k in zip(shapes, kinds)]
    for i in (13, 14):
        buffers[i] = np.sort(rng.uniform(0, max(buffers[i].size - 1, 0), buffers[i].size)).astype(np.float32)
    buffers[15] = (buffers[15] * 0.1).astype(np.float32)  # feedback weights are small (|w| <= 64 is the bound)
    sink, recent = cfg.sink, cfg.recent
    filled = max(min(sink, caps[0]) + min(recent, caps[1]) + caps[2] - max(t, 0), 0)
    err = ctypes.create_string_buffer(256)
    rc = lib.oscar_attention(ctypes.byref(cfg), (ctypes.c_int64 * 7)(*dims),
                             (ctypes.c_void_p * 17)(*[b.ctypes.data for b in buffers]),
                             (ctypes.c_int64 * 17)(*[b.size for b in buffers]), ctypes.c_int64(pick([int(rng.integers(0, filled + 1))], (-5, 80))),
                             err, len(err))
    counts["accepted" if rc == 0 else "refused"] += 1
print(json.dumps(counts))
"""


def fuzz_c_api(seed: int, cases: int) -> Counter:
    """Random configs, dims, buffer sizes and lengths into oscar_attention, in a child process: every call
    returns 0 or an error, never touches memory past a buffer, never crashes."""
    from oscar_export.native import core_library_path

    proc = subprocess.run([sys.executable, "-c", C_API_CASES, str(Path(__file__).parent), str(core_library_path()),
                           str(seed), str(cases)], capture_output=True, text=True, timeout=600)
    if proc.returncode < 0:
        return Counter({"crash": 1})
    if proc.returncode:
        return Counter({"traceback": 1})
    return Counter(json.loads(proc.stdout.strip().splitlines()[-1]))


def run(cases: int, seed: int, artifact: Path, tmp: Path, native_cases: int) -> dict[str, Counter]:
    rng = np.random.default_rng(seed)
    return {
        "rotation files": fuzz_rotation_files(rng, cases, tmp),
        "manifests": fuzz_manifests(rng, cases, artifact, tmp),
        "artifact files": fuzz_artifact_files(rng, cases, artifact, tmp),
        "hostile files": hostile_manifest_files(artifact, tmp),
        "manifest fields": manifest_field_edits(artifact, tmp),
        "hostile traces": hostile_traces(artifact, tmp),
        "hostile checkpoints": hostile_checkpoints(tmp),
        "--out entries": out_entries(artifact, tmp),
        "native loads": fuzz_native_loads(rng, native_cases, artifact, tmp),
        "C API": fuzz_c_api(seed, cases * 10),
    }


def main() -> int:
    import tempfile

    p = argparse.ArgumentParser(description="Fuzz the files oscar-export reads.")
    p.add_argument("--cases", type=int, default=500, help="cases per family (default %(default)s)")
    p.add_argument("--native-cases", type=int, default=50, help="damaged native loads (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--artifact", type=Path, help="a laptop artifact (default: export the bundled model)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        artifact = args.artifact
        if artifact is None:
            from oscar_export.export.pipeline import export_artifact
            from oscar_export.targets import get

            artifact = tmp / "artifact"
            export_artifact(get("laptop"), "bundled", artifact, "hadamard", 256, float_weights=True)
        results = run(args.cases, args.seed, artifact, tmp, args.native_cases)
    bad = 0
    for family, counts in results.items():
        print(f"{family}: " + ", ".join(f"{key} {counts.get(key, 0)}" for key in OUTCOMES))
        bad += sum(counts.get(key, 0) for key in BAD)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
