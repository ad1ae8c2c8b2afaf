"""The target registry: one registered object per target that every command asks, one export pipeline,
and a package whose modules import one way."""

import ast
import dataclasses
import io
import json
import tokenize
from pathlib import Path

import pytest

from oscar_export import targets as registry_module
from oscar_export.cli.main import build_parser
from oscar_export.config import OscarConfig
from oscar_export.export.artifact import load_manifest
from oscar_export.bench import RUNTIMES
from oscar_export.export.pipeline import export_artifact
from oscar_export.run import reference_trace, run_artifact
from oscar_export.parity import run_artifact_parity
from oscar_export.targets import REFERENCE, Lowered, Target, TargetOptions, get, names, registry

PACKAGE = Path(registry_module.__file__).resolve().parent.parent


def test_every_target_package_registers_one_target():
    found = sorted(p.name for p in (PACKAGE / "targets").iterdir() if (p / "__init__.py").is_file())
    assert list(names()) == found == ["android", "ios", "laptop"]
    for name, target in registry().items():
        assert target.name == name and isinstance(target, Target)
        assert dataclasses.is_dataclass(target.options) and isinstance(target.options, TargetOptions)
        assert target.run_runtimes()[-1] == REFERENCE and target.run_runtimes()[0] in target.runtimes
        assert "oscar-export" in target.packages and target.description


def test_the_cli_offers_what_the_registry_holds():
    parser = build_parser()
    top = {a.dest: a for a in parser._actions}
    assert tuple(top["target"].choices) == names()
    sub = top["command"].choices
    run_runtimes = {a.dest: a for a in sub["run"]._actions}["runtime"].choices
    assert set(run_runtimes) == {r for t in registry().values() for r in t.run_runtimes()}
    bench = {a.dest: a for a in sub["bench"]._actions}
    assert tuple(bench["runtime"].choices) == tuple(RUNTIMES)
    assert set(RUNTIMES) <= {t.runtime for t in registry().values()}  # each needs its target's packages


def _string_literals(path: Path) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {ast.literal_eval(t.string) for t in tokens if t.type == tokenize.STRING and not t.string.startswith("f")
            and not t.string.startswith(('"""', "'''"))}


def test_no_target_name_is_written_outside_its_own_package():
    for path in PACKAGE.rglob("*.py"):
        own = path.relative_to(PACKAGE).parts
        for name in names():
            if own[:2] == ("targets", name):
                continue
            assert name not in _string_literals(path), f"{path} names the {name} target"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """oscar_export modules a module imports when it is loaded (imports inside functions excluded)."""
    name, is_package = _module(path), path.name == "__init__.py"
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = name.split(".") if is_package else name.split(".")[:-1]
            if node.level:
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.add(full if full in modules else source)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles():
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _top_level_imports(p, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}

    def visit(module, stack):
        state[module] = 1
        for dep in graph[module]:
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*stack, module, dep])
            if dep not in state:
                visit(dep, [*stack, module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def _all_imports(path: Path, modules: set[str]) -> set[str]:
    """oscar_export modules a module imports anywhere, inside functions too."""
    name, is_package = _module(path), path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = name.split(".") if is_package else name.split(".")[:-1]
            source = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                      if node.level else node.module or "")
            found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                         for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _unit(module: str) -> str:
    """The package a module belongs to (oscar_export.targets.laptop.lower -> targets), or the top-level module."""
    return module.split(".")[1] if module.count(".") else module


def test_no_two_packages_import_each_other():
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges = {(_unit(m), _unit(dep)) for m, p in paths.items() for dep in _all_imports(p, set(paths))
             if _unit(m) != _unit(dep)}
    both = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not both, f"packages importing each other (counting imports inside functions): {both}"


@dataclasses.dataclass(frozen=True)
class _NoteOptions(TargetOptions):
    max_chunk: int = 64
    note: str = "hello"


class _NoteTarget(Target):
    """A target whose lowering writes the cache layout it was given: enough to drive the whole pipeline."""

    name = "notes"
    runtime = "json"
    description = "a JSON note of the lowered graph"
    options = _NoteOptions()
    packages = ("oscar-export", "torch")
    runtimes = {"eager": "the reference graph again", "picky": "a runtime that cannot take every prompt"}

    def trace(self, directory, manifest, runtime, ids, steps, forced=None):
        if runtime == "picky":
            return {"skipped": "it takes text, and this prompt's text does not tokenize back"}
        return reference_trace(directory, ids, steps)

    def lower(self, module, model, tokenizer, max_context, max_chunk, float_weights, options, weights=None):
        spec = [[name, list(shape), str(dtype).removeprefix("torch.")] for name, shape, dtype in
                module.cache_spec(max_context)]
        note = {"note": options.note, "max_chunk": max_chunk, "cache": spec, "vocab": module.lm_head.out_features}
        return Lowered(lambda temp: (temp / "note.json").write_text(json.dumps(note)), "float32", {"note": options.note})

    def weight_plan(self, options, float_weights):
        return {"weight_bits": 16}

    def program_io(self, directory):
        note = json.loads((directory / "note.json").read_text())
        return [("note.json", {name: (tuple(shape), dtype) for name, shape, dtype in note["cache"]}, note["vocab"],
                 note["max_chunk"])]


@pytest.fixture
def notes_target(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry()))
    return registry_module.register(_NoteTarget())


def test_a_registered_target_goes_through_the_one_pipeline(notes_target, tmp_path):
    out = tmp_path / "notes"
    manifest = export_artifact(get("notes"), "bundled", out, "hadamard", 128,
                               config=OscarConfig(k_bits=2, v_bits=2, sink=4, recent=8))
    assert get("notes") is notes_target and manifest["target"] == "notes" and manifest["note"] == "hello"
    note = json.loads((out / "note.json").read_text())
    assert note["max_chunk"] == 64 and manifest["max_chunk"] == 64  # the target's option, capped by the context
    assert note["cache"][0] == ["layer0.k_sink", [manifest["model"]["kv_heads"], 4, manifest["model"]["head_dim"]],
                                "float16"]
    assert load_manifest(out)["files"]["note.json"]["bytes"] == (out / "note.json").stat().st_size
    assert manifest["plan"]["context"] == 128 and manifest["rotations"] == "hadamard"
    assert manifest["plan"]["weight_bits"] == 16  # the target's weight_plan
    # The reference runtime is every target's: the eager graph over the artifact's own config and weights.
    result = run_artifact(out, "KING.", 3, REFERENCE)
    assert len(result["tokens"]) == 3 and isinstance(result["text"], str)
    # parity asks the target for its runtimes; one that cannot take the prompt is listed with its reason.
    report = run_artifact_parity(out, result["tokens"][:1] + [5, 6, 7], 4, answers=False)
    assert set(report["runtimes"]) == {"eager"} and report["ok"] and "tokenize back" in report["unavailable"]["picky"]
    row = report["runtimes"]["eager"]
    assert row["codes_mismatched"] == 0 and row["logits_max_abs_error"] == 0 and len(row["tokens"]) == 4
