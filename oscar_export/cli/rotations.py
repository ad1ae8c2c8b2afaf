"""`oscar-export rotations`: convert RotationZoo files to and from ours, and check a rotation file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..config import OscarInputError

out = Console()


def _layout(kv_heads: int | None) -> str:
    return "per layer" if kv_heads is None else f"per KV head ({kv_heads} KV heads)"


def cmd_convert(args: argparse.Namespace) -> int:
    from ..calibration.files import export_rotation_zoo, import_rotation_zoo, load_rotations, save_rotations, zoo_paths

    if args.to_zoo:
        paired = args.k is not None and args.v is not None
        if args.source is None or paired == (args.out is not None) or (args.k is None) != (args.v is None):
            raise OscarInputError("--to-zoo: expected --from FILE.safetensors and either --k K.pt --v V.pt "
                                  "or --out DIR (the reference's file names)")
        rs = load_rotations(args.source)
        k_path, v_path = (args.k, args.v) if paired else zoo_paths(rs, args.out)
        if args.source.resolve() in (Path(k_path).resolve(), Path(v_path).resolve()):
            raise OscarInputError(f"{k_path if Path(k_path).resolve() == args.source.resolve() else v_path}: is the "
                                  f"--from file: expected new RotationZoo file paths")
        export_rotation_zoo(rs, k_path, v_path)
        written = f"{k_path} and {v_path}"
    else:
        if args.k is None or args.v is None or args.out is None or args.source is not None:
            raise OscarInputError("convert: expected --k K.pt --v V.pt --out FILE.safetensors, or --from with --to-zoo")
        if args.out.resolve() in (args.k.resolve(), args.v.resolve()):
            raise OscarInputError(f"--out {str(args.out)!r} is one of the inputs: expected a new file")
        rs = import_rotation_zoo(args.k, args.v)
        save_rotations(args.out, rs)
        written = str(args.out)
    out.print(f"wrote {written}: {rs.layers} layers, head_dim {rs.head_dim}, {_layout(rs.kv_heads)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from ..calibration.files import check_report

    report = check_report(args.file)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    table = Table(title=f"Rotation file {report['file']}")
    table.add_column("item")
    table.add_column("value")
    table.add_row("layers", str(report["layers"]))
    table.add_row("head_dim", str(report["head_dim"]))
    table.add_row("layout", _layout(report["kv_heads"]))
    table.add_row("max |R^T R - I| (K and V)", f"{report['max_orthogonality_error']:.3g}")
    for key, value in sorted(report["metadata"].items()):
        if key not in report:  # layers, head_dim, kv_heads are shown above
            table.add_row(key, json.dumps(value))
    out.print(table)
    return 0


def add_rotations_command(subparsers) -> None:
    """Register `rotations convert` and `rotations check` on the main CLI's subparsers."""
    p = subparsers.add_parser("rotations", help="convert and check rotation files",
                              description="Convert RotationZoo .pt files to and from OSCAR rotation files; check one.")
    sub = p.add_subparsers(dest="rotations_command", metavar="{convert,check}", required=True, parser_class=type(p))

    c = sub.add_parser("convert", help="RotationZoo K/V .pt files <-> one OSCAR .safetensors file",
                       description="Import: --k K.pt --v V.pt --out FILE.safetensors. "
                                   "Export: --from FILE.safetensors --to-zoo, then --k K.pt --v V.pt or --out DIR "
                                   "(writes DIR/k_rotation_<K objective>.pt and DIR/v_rotation_<V objective>.pt).")
    c.add_argument("--k", type=Path, help="RotationZoo file of the K rotations")
    c.add_argument("--v", type=Path, help="RotationZoo file of the V rotations")
    c.add_argument("--out", type=Path, help="OSCAR rotation file to write (import), or a directory for --to-zoo")
    c.add_argument("--from", dest="source", type=Path, help="OSCAR rotation file to read (export with --to-zoo)")
    c.add_argument("--to-zoo", action="store_true", help="write --k and --v RotationZoo files from --from")
    c.set_defaults(func=cmd_convert)

    c = sub.add_parser("check", help="validate a rotation file and show its shape, orthogonality and metadata",
                       description="Validate an OSCAR rotation file: shapes, finiteness, orthogonality, metadata.")
    c.add_argument("file", type=Path, help="OSCAR rotation file (.safetensors)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_check)
