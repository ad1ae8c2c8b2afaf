"""Rotation files: our safetensors format, RotationZoo import/export, refusal of bad and malicious files."""

import argparse
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oscar_export import OscarInputError
from oscar_export.calibration import files as rotation_files
from oscar_export.cli.rotations import add_rotations_command
from oscar_export.calibration.files import (
    RotationSet,
    check_report,
    export_rotation_zoo,
    import_rotation_zoo,
    load_rotations,
    max_orthogonality_error,
    save_rotations,
    zoo_paths,
)
from oscar_export.calibration.rotations import hadamard_rotations

LAYERS, D, HEADS = 3, 8, 2


def orthogonal(seed, *lead):
    q, _ = torch.linalg.qr(torch.randn(*lead, D, D, generator=torch.Generator().manual_seed(seed)))
    return q.contiguous()


# The reference's rotation script writes one file per target, {target}_rotation_{hessian}_{composition}.pt:
# K fitted on q q^T, V on s s^T, each file with its own objective; data-free files say "hadamard".
COMPOSITIONS = ("plain", "pbr", "br", "br_h128", "r_h", "h_pbr", "h_r_pbr", "h_pbr_r", "r_h_pbr")


def zoo(seed=0, layers=LAYERS, heads=None, version=None, objective="qqt_h_pbr", str_keys=False):
    """A RotationZoo dict as the reference writes it: v1 per layer, v2 per KV head when heads is given;
    `layers` keyed by layer id, each entry repeating its layer_id."""
    lead = () if heads is None else (heads,)
    return {
        "format_version": version or (1 if heads is None else 2),
        "objective": objective,
        "source_grouping": "layer",
        "layers": {
            (str(i) if str_keys else i): {"layer_id": i, "rotation": orthogonal(seed + i, *lead),
                                          "eigenvalues": torch.rand(*lead, D)}
            for i in range(layers)
        },
    }


def write_zoo_pair(tmp_path, composition="h_pbr", **kw):
    k, v = tmp_path / f"k_rotation_qqt_{composition}.pt", tmp_path / f"v_rotation_sst_{composition}.pt"
    torch.save(zoo(seed=0, objective=f"qqt_{composition}", **kw), k)
    torch.save(zoo(seed=100, objective=f"sst_{composition}", **kw), v)
    return k, v


def raw_file(path, tensors, metadata=None):
    """A safetensors file written without save_rotations' validation."""
    header = {"format_version": "1", "oscar": json.dumps(metadata or {})}
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=header)
    return path


def assert_same_zoo(a, b):
    """Equal headers, the same layer ids, and every tensor equal in dtype and bytes."""
    assert {key: a[key] for key in a if key != "layers"} == {key: b[key] for key in b if key != "layers"}
    assert [int(i) for i in a["layers"]] == [int(i) for i in b["layers"]]
    for (i, entry), other in zip(a["layers"].items(), b["layers"].values()):
        assert int(other["layer_id"]) == int(i)
        for key in ("rotation", "eigenvalues"):
            assert entry[key].dtype == other[key].dtype
            assert entry[key].numpy().tobytes() == other[key].numpy().tobytes()


# -- RotationZoo import / export ---------------------------------------------------------


def round_trip(tmp_path, k_zoo, v_zoo, heads=None):
    """zoo -> our file -> zoo in a directory under the reference's names; returns the imported set."""
    rs = import_rotation_zoo(k_zoo, v_zoo)
    ours = tmp_path / "rot.safetensors"
    save_rotations(ours, rs)
    back = load_rotations(ours, layers=LAYERS, head_dim=D, kv_heads=heads)
    out = tmp_path / "zoo_again"
    export_rotation_zoo(back, *zoo_paths(back, out))
    for original in (k_zoo, v_zoo):
        assert_same_zoo(torch.load(original, weights_only=True), torch.load(out / original.name, weights_only=True))
    assert not list(tmp_path.rglob(".*.tmp"))
    return rs


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_qqt_sst_pair_of_every_composition_round_trips(tmp_path, composition):
    k_zoo, v_zoo = write_zoo_pair(tmp_path, composition)
    rs = round_trip(tmp_path, k_zoo, v_zoo)
    assert rs.metadata["k_objective"] == f"qqt_{composition}" and rs.metadata["v_objective"] == f"sst_{composition}"
    assert rs.metadata["source_grouping"] == "layer" and rs.metadata["zoo_format_version"] == 1


@pytest.mark.parametrize("objective", ["hadamard", "uresidual"])
def test_data_free_and_uresidual_pairs_round_trip(tmp_path, objective):
    k, v = tmp_path / f"k_rotation_{objective}.pt", tmp_path / f"v_rotation_{objective}.pt"
    torch.save(zoo(seed=0, objective=objective), k)
    torch.save(zoo(seed=100, objective=objective), v)
    rs = round_trip(tmp_path, k, v)
    assert rs.metadata["k_objective"] == rs.metadata["v_objective"] == objective


@pytest.mark.parametrize("heads", [None, HEADS])
def test_zoo_import_then_export_is_exact(tmp_path, heads):
    k_zoo, v_zoo = write_zoo_pair(tmp_path, heads=heads)
    rs = round_trip(tmp_path, k_zoo, v_zoo, heads)
    shape = (LAYERS, D, D) if heads is None else (LAYERS, heads, D, D)
    assert rs.k.shape == rs.v.shape == shape and rs.k.dtype == torch.float32
    assert (rs.layers, rs.head_dim, rs.per_head, rs.kv_heads) == (LAYERS, D, heads is not None, heads)
    assert rs.k_eigenvalues.shape == shape[:-1]
    assert rs.metadata["zoo_format_version"] == (1 if heads is None else 2)
    assert torch.equal(rs.k[1], torch.load(k_zoo, weights_only=True)["layers"][1]["rotation"])


def test_string_layer_keys_are_read_as_the_reference_loader_reads_them(tmp_path):
    k, v = tmp_path / "K.pt", tmp_path / "V.pt"
    torch.save(zoo(seed=0, str_keys=True), k)
    torch.save(zoo(seed=100, objective="sst_h_pbr"), v)
    rs = import_rotation_zoo(k, v)
    assert torch.equal(rs.k[2], torch.load(k, weights_only=True)["layers"]["2"]["rotation"])


def test_malicious_pickle_is_refused_without_running(tmp_path):
    class Payload:
        def __init__(self, target):
            self.target = target

        def __reduce__(self):
            return (open, (str(self.target), "w"))  # creating the file proves the code ran

    # The payload is live: a plain unpickle runs it.
    control = tmp_path / "CONTROL"
    torch.save({"x": Payload(control)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()

    sentinel = tmp_path / "SENTINEL"
    k, _ = write_zoo_pair(tmp_path)
    evil = zoo(seed=100)
    evil["layers"][1]["rotation"] = Payload(sentinel)
    torch.save(evil, tmp_path / "evil.pt")
    with pytest.raises(OscarInputError, match="evil.pt: refused to unpickle"):
        import_rotation_zoo(k, tmp_path / "evil.pt")
    assert not sentinel.exists()


def bad_zoo(mutate):
    def make(path):
        data = zoo()
        mutate(data)
        torch.save(data, path)

    return make


def set_layer(i, key, value):
    return bad_zoo(lambda data: data["layers"][i].__setitem__(key, value))


def nan_rotation(data):
    data["layers"][1]["rotation"][2, 3] = float("nan")


@pytest.mark.parametrize(
    "make, needle",
    [
        (set_layer(1, "rotation", orthogonal(5)[:4]), "layer 1 rotation is a float32 tensor of shape (4, 8)"),
        (set_layer(1, "rotation", torch.eye(4)), "layer 1 rotation has shape (4, 4): expected (8, 8) like layer 0"),
        (set_layer(2, "rotation", orthogonal(5) * 1.01), "rotation at layer 2 is not orthogonal"),
        (set_layer(2, "rotation", orthogonal(5).double()), "float64"),
        (set_layer(0, "rotation", orthogonal(5, HEADS)), "format_version 1"),
        (set_layer(0, "eigenvalues", torch.ones(D + 1)), "layer 0 eigenvalues"),
        (set_layer(0, "eigenvalues", [1.0] * D), "layer 0 eigenvalues are a list"),
        (bad_zoo(nan_rotation), "rotation at layer 1 contains NaN"),
        (bad_zoo(lambda d: d["layers"][0]["eigenvalues"].__setitem__(0, float("inf"))), "eigenvalues contains inf"),
        (bad_zoo(lambda d: d.pop("objective")), "missing keys ['objective']"),
        (bad_zoo(lambda d: d["layers"][1].pop("eigenvalues")), "layer 1 is missing ['eigenvalues']"),
        (bad_zoo(lambda d: d["layers"].__setitem__(5, d["layers"].pop(1))), "layer id 5"),
        (bad_zoo(lambda d: d["layers"].__setitem__("one", d["layers"].pop(1))), "layer id 'one'"),
        (bad_zoo(lambda d: d["layers"].__setitem__("1", d["layers"][1])), "layer 1 appears twice"),
        (set_layer(2, "layer_id", 0), "layer 2 has layer_id=0: expected 2"),
        (bad_zoo(lambda d: d.__setitem__("layers", {})), "'layers' is a dict"),
        (bad_zoo(lambda d: d.__setitem__("format_version", 3)), "format_version=3"),
        (bad_zoo(lambda d: d.__setitem__("objective", torch.ones(1))), "objective is a float32 tensor"),
        (lambda path: torch.save(torch.eye(D), path), "holds a float32 tensor"),
        (lambda path: path.write_bytes(b"not a pickle at all"), "not a torch file"),
        (lambda path: path.mkdir(), "not a file"),
    ],
)
def test_bad_zoo_file_names_the_file(tmp_path, make, needle):
    k, _ = write_zoo_pair(tmp_path)
    bad = tmp_path / "broken_v.pt"
    make(bad)
    with pytest.raises(OscarInputError) as err:
        import_rotation_zoo(k, bad)
    assert str(bad) in str(err.value) and needle in str(err.value)


def test_missing_zoo_file(tmp_path):
    with pytest.raises(OscarInputError, match="nope.pt: not a file"):
        import_rotation_zoo(tmp_path / "nope.pt", tmp_path / "nope.pt")


def test_zoo_k_and_v_must_match(tmp_path):
    k, v = tmp_path / "K.pt", tmp_path / "V.pt"
    torch.save(zoo(layers=3), k)
    torch.save(zoo(layers=2), v)
    with pytest.raises(OscarInputError, match="V.pt: 2 layers .* but .*K.pt has 3 layers"):
        import_rotation_zoo(k, v)
    torch.save(zoo(heads=HEADS, layers=3), v)
    with pytest.raises(OscarInputError, match="V.pt: 3 layers of \\(2, 8, 8\\)"):
        import_rotation_zoo(k, v)
    other = zoo(layers=3)
    other["source_grouping"] = "kv_head"
    torch.save(other, v)
    with pytest.raises(OscarInputError, match="V.pt: source_grouping='kv_head' but .*K.pt has source_grouping='layer'"):
        import_rotation_zoo(k, v)
    torch.save(zoo(layers=3, version=2), v)
    with pytest.raises(OscarInputError, match="V.pt: format_version=2 but .*K.pt has format_version=1"):
        import_rotation_zoo(k, v)


def test_export_needs_eigenvalues_and_two_paths(tmp_path):
    h = hadamard_rotations(LAYERS, D)
    rs = RotationSet(k=h, v=h, metadata={"objective": "hadamard"})
    with pytest.raises(OscarInputError, match="no eigenvalues"):
        export_rotation_zoo(rs, tmp_path / "K.pt", tmp_path / "V.pt")
    with pytest.raises(OscarInputError, match="K.pt: given for both K and V"):
        export_rotation_zoo(rs, tmp_path / "K.pt", tmp_path / "K.pt")


# -- our format ----------------------------------------------------------------------------


def test_save_load_with_levels_and_eigenvalues(tmp_path):
    levels = torch.tensor([0.0, 0.9, 2.1, 3.0]).expand(LAYERS, 4)
    rs = RotationSet(
        k=orthogonal(1, LAYERS),
        v=orthogonal(2, LAYERS),
        metadata={"model": "tiny", "objective": "oscar", "composition": "U.H.P_br", "k_clip": 0.96,
                  "v_clip": 0.92, "codebook": "lloyd-max", "k_bits": 2, "v_bits": 2, "source": "test"},
        k_levels=levels,
        v_levels=levels,
        k_eigenvalues=torch.rand(LAYERS, D),
        v_eigenvalues=torch.rand(LAYERS, D),
    )
    path = tmp_path / "rot.safetensors"
    save_rotations(path, rs)
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
        assert set(f.keys()) == set(rotation_files.TENSOR_NAMES) - {"k_feedback"}
    assert header["format_version"] == "1"
    assert json.loads(header["oscar"]) == {**rs.metadata, "layers": LAYERS, "head_dim": D, "kv_heads": None}

    back = load_rotations(path, layers=LAYERS, head_dim=D, kv_heads=4)  # a per-layer set serves any kv_heads
    for name in ("k", "v", "k_levels", "v_levels", "k_eigenvalues", "v_eigenvalues"):
        assert torch.equal(getattr(back, name), getattr(rs, name))
    assert back.metadata["composition"] == "U.H.P_br" and not back.per_head

    report = check_report(path)
    assert (report["layers"], report["head_dim"], report["per_head"], report["kv_heads"]) == (LAYERS, D, False, None)
    assert report["max_orthogonality_error"] < 1e-5 and report["metadata"]["model"] == "tiny"


def feedback_weights(seed, heads=HEADS, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.triu(torch.randn(LAYERS, heads, D, D, generator=g), 1) * scale


def test_feedback_weights_round_trip_and_fix_the_kv_heads(tmp_path):
    path = tmp_path / "fb.safetensors"
    weights = feedback_weights(1)
    rs = RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS), metadata={"k_rounding": "feedback"},
                     k_feedback=weights)
    save_rotations(path, rs)
    back = load_rotations(path, layers=LAYERS, head_dim=D, kv_heads=HEADS)
    assert torch.equal(back.k_feedback, weights) and back.metadata["k_rounding"] == "feedback"
    assert check_report(path)["kv_heads"] == HEADS  # per-layer rotations, but the weights are per KV head
    with pytest.raises(OscarInputError, match="fb.safetensors: kv_heads=2 in the file: expected kv_heads=4"):
        load_rotations(path, kv_heads=4)


@pytest.mark.parametrize("kwargs, needle", [
    ({"metadata": {"k_rounding": "feedback"}}, "k_rounding 'feedback' but no k_feedback"),
    ({"k_feedback": feedback_weights(1)[:, :, :4]}, "k_feedback is a float32 tensor of shape (3, 2, 4, 8)"),
    ({"k_feedback": feedback_weights(1).double()}, "k_feedback is a float64 tensor"),
    ({"k_feedback": feedback_weights(1, scale=100.0)}, "expected |weights| <= 64"),
    ({"k_feedback": feedback_weights(1) * float("nan")}, "k_feedback contains NaN"),
    ({"metadata": {"k_rounding": "stochastic"}}, "metadata k_rounding='stochastic': expected one of"),
])
def test_bad_feedback_weights_are_refused(tmp_path, kwargs, needle):
    with pytest.raises(OscarInputError) as err:
        save_rotations(tmp_path / "fb.safetensors", RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS),
                                                                **kwargs))
    assert needle in str(err.value)
    assert not (tmp_path / "fb.safetensors").exists()


def test_shared_k_v_tensor_saves(tmp_path):
    # hadamard sets often pass one tensor for K and V; safetensors refuses shared memory unless copied
    h = hadamard_rotations(LAYERS, D)
    save_rotations(tmp_path / "h.safetensors", RotationSet(k=h, v=h, metadata={"objective": "hadamard"}))
    assert torch.equal(load_rotations(tmp_path / "h.safetensors").v, h)


def test_per_head_file(tmp_path):
    path = tmp_path / "heads.safetensors"
    save_rotations(path, RotationSet(k=orthogonal(1, LAYERS, HEADS), v=orthogonal(2, LAYERS, HEADS)))
    rs = load_rotations(path, kv_heads=HEADS)
    assert rs.per_head and rs.kv_heads == HEADS and rs.k.shape == (LAYERS, HEADS, D, D)
    with pytest.raises(OscarInputError, match="heads.safetensors: kv_heads=2 in the file: expected kv_heads=4"):
        load_rotations(path, kv_heads=4)

    k = orthogonal(1, LAYERS, HEADS)
    k[1, 1] *= 2
    raw_file(path, {"k_rotation": k, "v_rotation": orthogonal(2, LAYERS, HEADS)})
    with pytest.raises(OscarInputError, match="heads.safetensors: k_rotation at layer 1, KV head 1 is not orthogonal: "
                                              "max \\|R\\^T R - I\\| = 3, expected < 0.0001"):
        load_rotations(path)


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "rot.safetensors"
    good = RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS))
    save_rotations(path, good)
    before = path.read_bytes()

    def half_written(tensors, filename, metadata):
        open(filename, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rotation_files, "save_file", half_written)
    with pytest.raises(OscarInputError, match="rot.safetensors: cannot write \\(No space left on device\\)"):
        save_rotations(path, RotationSet(k=orthogonal(3, LAYERS), v=orthogonal(4, LAYERS)))
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["rot.safetensors"]

    with pytest.raises(OscarInputError, match="no_dir/rot.safetensors: cannot write here"):
        save_rotations(tmp_path / "no_dir" / "rot.safetensors", good)


def test_save_refuses_bad_sets(tmp_path):
    path = tmp_path / "rot.safetensors"
    bad = orthogonal(1, LAYERS)
    bad[2] += 0.01
    with pytest.raises(OscarInputError, match="rot.safetensors: k_rotation at layer 2 is not orthogonal"):
        save_rotations(path, RotationSet(k=bad, v=orthogonal(2, LAYERS)))
    with pytest.raises(OscarInputError, match="rot.safetensors: metadata is not JSON"):
        save_rotations(path, RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS), metadata={"x": {1, 2}}))
    with pytest.raises(OscarInputError, match="codebook 'lloyd-max' but k_levels absent"):
        save_rotations(path, RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS),
                                         metadata={"codebook": "lloyd-max"}))
    with pytest.raises(OscarInputError, match="k_levels is a float32 tensor of shape \\(3, 8\\): .*L in \\(4,\\)"):
        save_rotations(path, RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS), metadata={"k_bits": 2},
                                         k_levels=torch.arange(8.0).expand(LAYERS, 8)))
    assert not path.exists()


def nan_k(path):
    k = orthogonal(1, LAYERS)
    k[1, 0, 0] = float("nan")
    raw_file(path, {"k_rotation": k, "v_rotation": orthogonal(2, LAYERS)})


@pytest.mark.parametrize(
    "make, kwargs, needle",
    [
        (nan_k, {}, "k_rotation at layer 1 contains NaN"),
        (lambda p: raw_file(p, {"k_rotation": orthogonal(1, LAYERS), "v_rotation": orthogonal(2, LAYERS + 1)}), {},
         "k_rotation (3, 8, 8) and v_rotation (4, 8, 8) differ"),
        (lambda p: raw_file(p, {"k_rotation": orthogonal(1, LAYERS), "v_rotation": orthogonal(2, LAYERS)[..., :4]}), {},
         "v_rotation is a float32 tensor of shape (3, 8, 4)"),
        (lambda p: raw_file(p, {"k_rotation": orthogonal(1, LAYERS)}), {}, "missing tensors ['v_rotation']"),
        (lambda p: raw_file(p, {"k_rotation": orthogonal(1, LAYERS), "v_rotation": orthogonal(2, LAYERS),
                                "extra": torch.ones(1)}), {}, "unknown tensors ['extra']"),
        (lambda p: raw_file(p, {"k_rotation": orthogonal(1, LAYERS), "v_rotation": orthogonal(2, LAYERS)},
                            {"layers": 7}), {}, "metadata says layers=7 but the tensors have 3"),
        (lambda p: save_file({"k_rotation": orthogonal(1, LAYERS)}, str(p)), {}, "header format_version=None"),
        (lambda p: torch.save(zoo(), p), {}, "not a safetensors file"),
        (lambda p: p.mkdir(), {}, "not a file"),
        (lambda p: None, {}, "not a file"),
        (lambda p: save_rotations(p, RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS))), {"layers": 32},
         "layers=3 in the file: expected layers=32"),
        (lambda p: save_rotations(p, RotationSet(k=orthogonal(1, LAYERS), v=orthogonal(2, LAYERS))), {"head_dim": 128},
         "head_dim=8 in the file: expected head_dim=128"),
    ],
)
def test_bad_rotation_file_names_the_file(tmp_path, make, kwargs, needle):
    path = tmp_path / "bad_rot.safetensors"
    make(path)
    with pytest.raises(OscarInputError) as err:
        load_rotations(path, **kwargs)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_max_orthogonality_error():
    assert max_orthogonality_error(torch.eye(D)) == 0
    assert max_orthogonality_error(torch.stack([torch.eye(D), 2 * torch.eye(D)])) == pytest.approx(3)


# -- command line --------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """Like the main CLI's parser: errors exit 2 without a usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def rotations(*argv):
    parser = OneLineParser(prog="oscar-export")
    add_rotations_command(parser.add_subparsers(dest="command", parser_class=OneLineParser))
    args = parser.parse_args(["rotations", *argv])
    return args.func(args)


def test_cli_convert_check_and_back(tmp_path, capsys):
    k, v = write_zoo_pair(tmp_path, heads=HEADS)
    ours = tmp_path / "rot.safetensors"
    assert rotations("convert", "--k", str(k), "--v", str(v), "--out", str(ours)) == 0
    assert "wrote" in capsys.readouterr().out

    assert rotations("check", str(ours), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["per_head"] and report["kv_heads"] == HEADS
    assert (report["metadata"]["k_objective"], report["metadata"]["v_objective"]) == ("qqt_h_pbr", "sst_h_pbr")

    assert rotations("check", str(ours)) == 0
    table = capsys.readouterr().out
    assert "per KV head (2 KV heads)" in table and "source_grouping" in table

    k2, v2 = tmp_path / "K2.pt", tmp_path / "V2.pt"
    assert rotations("convert", "--from", str(ours), "--to-zoo", "--k", str(k2), "--v", str(v2)) == 0
    assert_same_zoo(torch.load(k, weights_only=True), torch.load(k2, weights_only=True))
    assert_same_zoo(torch.load(v, weights_only=True), torch.load(v2, weights_only=True))

    # Into a directory: the reference's file names, from each file's own objective.
    assert rotations("convert", "--from", str(ours), "--to-zoo", "--out", str(tmp_path / "zoo")) == 0
    assert sorted(p.name for p in (tmp_path / "zoo").iterdir()) == [k.name, v.name]
    assert_same_zoo(torch.load(k, weights_only=True), torch.load(tmp_path / "zoo" / k.name, weights_only=True))


def test_cli_bad_input(tmp_path, capsys):
    k, v = write_zoo_pair(tmp_path)
    with pytest.raises(OscarInputError, match="--to-zoo: expected --from"):
        rotations("convert", "--to-zoo", "--k", str(k), "--v", str(v))
    with pytest.raises(OscarInputError, match="convert: expected --k K.pt --v V.pt --out"):
        rotations("convert", "--k", str(k), "--v", str(v))
    ours = tmp_path / "rot.safetensors"
    rotations("convert", "--k", str(k), "--v", str(v), "--out", str(ours))
    with pytest.raises(OscarInputError, match="--to-zoo: expected --from FILE.safetensors and either"):
        rotations("convert", "--from", str(ours), "--to-zoo", "--k", str(k), "--out", str(tmp_path))
    with pytest.raises(OscarInputError, match="is a file: expected a directory"):
        rotations("convert", "--from", str(ours), "--to-zoo", "--out", str(k))
    with pytest.raises(OscarInputError, match="missing.safetensors: not a file"):
        rotations("check", str(tmp_path / "missing.safetensors"))
    # nested parsers use the caller's parser class: one line, exit 2
    with pytest.raises(SystemExit) as exit_info:
        rotations()
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
