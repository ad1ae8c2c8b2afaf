"""Export targets: one package per target under this folder, each registering one Target.

A Target says what its artifact is (runtime, packages, defaults in a typed options dataclass),
lowers the exportable graph and writes its files (export/pipeline.py does everything else), runs an
artifact on each of its runtimes and traces it for parity. Every target package has the same files:
__init__.py declares and registers the Target and imports nothing heavy (the CLI reads every target
to build its flags), lower.py writes the artifact, runner.py runs it; the runtime's benches live in
oscar_export/bench/. The CLI's --target, `run`, `parity` and `info` ask this registry; adding a target is
adding a package here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..config import OscarConfig, OscarInputError
from ..sizes import SCALE_BUFFER_DTYPES

REFERENCE = "reference"  # every target's run/parity runtime: the eager graph with the artifact's own weights


@dataclass(frozen=True)
class TargetOptions:
    """Settings every target has; a target's subclass adds its own, with its defaults."""

    max_chunk: int = 512  # the longest prefill chunk one call takes; longer prompts run in chunks
    device_memory: str = "8GB"  # what the manifest's memory plan is made for


@dataclass
class Lowered:
    """What a target's lowering hands back to the pipeline: a writer for its files in the staging
    directory, how its weights are stored and extra manifest fields."""

    write: Callable[[Path], None]
    weights: str
    manifest: dict = field(default_factory=dict)


class Target:
    """One export target. Subclasses set the class attributes and implement lower() and runner()."""

    name: str
    runtime: str  # the runtime its artifact is for
    description: str
    options: TargetOptions = TargetOptions()
    packages: tuple[str, ...] = ()  # distributions whose versions the manifest records; all must be installed
    runtimes: dict[str, str] = {}  # run/parity runtimes besides the reference: name -> how it runs
    float_weights_help: str = "keep float weights"
    # lower() takes a graph traced on the meta device and a source of its weights (export/streamed.py), so a
    # safetensors checkpoint larger than memory exports one layer at a time.
    streams_weights: bool = False
    scale_dtypes: tuple[str, ...] = tuple(SCALE_BUFFER_DTYPES)  # the scale and zero storage its programs take
    # The fewest tokens its programs' fp16 sink and recent windows may hold: each is a buffer, and runtimes refuse
    # empty ones (ExecuTorch: "0 in strides"; Core ML inputs cannot be empty).
    min_window: int = 1

    @property
    def default_out(self) -> Path:
        return Path(f"oscar-{self.name}")

    def run_runtimes(self) -> tuple[str, ...]:
        """`run --runtime` choices, the default first."""
        return (*self.runtimes, REFERENCE)

    def missing(self) -> str | None:
        """Why this target cannot export here (a package is missing), or None."""
        for package in self.packages:
            module = package.replace("-", "_")
            if module != "oscar_export" and importlib.util.find_spec(module) is None:
                return f"the {package} package is not installed (pip install 'oscar-export[{self.name}]')"
        return None

    # -- export ----------------------------------------------------------------------------

    def add_export_flags(self, parser: argparse.ArgumentParser) -> None:
        """Flags of this target's export beyond the common ones (export/pipeline.py)."""

    def export_options(self, args: argparse.Namespace) -> TargetOptions:
        return self.options

    def check(self, options: TargetOptions, config: OscarConfig, max_context: int) -> None:
        """Reject a cache format or layout this target cannot run, before the model is loaded."""
        if config.scale_dtype not in self.scale_dtypes:
            raise OscarInputError(f"scale_dtype={config.scale_dtype!r}: expected "
                                  f"{' or '.join(map(repr, self.scale_dtypes))}, the scales the {self.name} target "
                                  "stores")
        for name in ("sink", "recent"):
            if getattr(config, name) < self.min_window:
                raise OscarInputError(f"--{name} {getattr(config, name)}: the {self.name} target needs a window of at "
                                      f"least {self.min_window} token (its runtime takes no empty buffer)")

    def weight_plan(self, options: TargetOptions, float_weights: bool) -> dict:
        """How the artifact stores its weights, as planner.plan's weight arguments."""
        return {"weight_bits": 16 if float_weights else 4}

    def lower(self, module, model, tokenizer, max_context: int, max_chunk: int, float_weights: bool,
              options: TargetOptions, weights=None) -> Lowered:
        """The artifact's writer. weights: None, or (streams_weights only) the export/streamed.StreamedWeights of
        `module`, built on the meta device (name -> tensor, or materialize() part by part), whose `model` is then a
        meta-device skeleton."""
        raise NotImplementedError

    # -- run and parity ----------------------------------------------------------------------

    def program_io(self, directory: Path) -> list[tuple[str, dict, int | None, int | None]]:
        """What each program file of the artifact declares, read without running it: (file name, cache buffers as
        {layer{i}.k_sink ...: (shape, element type)}, the logits' width, the longest chunk it takes or None)."""
        raise NotImplementedError

    def check_artifact(self, directory: Path, manifest: dict) -> None:
        """The verified manifest describes this target's programs: a manifest edited after the export (its hash
        covers only the files) is an error naming the field, never a program run with the wrong layout."""
        from ..export.artifact import MANIFEST, check_program

        if manifest.get("runtime") != self.runtime:
            raise OscarInputError(f"--artifact {str(directory)!r}: {MANIFEST}: runtime={manifest.get('runtime')!r}: "
                                  f"expected {self.runtime!r}, the runtime of {self.name} artifacts; re-export it")
        for program, layout, vocab, max_chunk in self.program_io(directory):
            check_program(directory, manifest, program, layout, vocab, max_chunk)

    def runner(self, directory: Path, manifest: dict, runtime: str, threads: int):
        """A GreedyLM (export/artifact.py) over the artifact on `runtime`, one of self.runtimes."""
        raise NotImplementedError

    def generate(self, directory: Path, manifest: dict, runtime: str, tokenizer, prompt: str, ids: list[int],
                 max_new_tokens: int, threads: int) -> dict:
        """Greedy generation on `runtime` from the prompt's ids (a runtime that takes text gets `prompt`):
        {"tokens": [...], "text": "..."}."""
        runner = self.runner(directory, manifest, runtime, threads)
        tokens = runner.generate(ids, max_new_tokens, manifest["eos_token_ids"])
        return {"tokens": tokens, "text": tokenizer.decode(tokens)}

    def artifact_module(self, directory: Path, manifest: dict, module=None):
        """The eager graph with the weights as the artifact stores them: the reference runtime. module: the eager
        graph with the source checkpoint's float weights (export/artifact.eager_module) to convert in place, when
        the caller holds one already."""
        from ..export.artifact import eager_module

        return eager_module(directory, manifest) if module is None else module

    def parity_limits(self, manifest: dict) -> dict[str, float]:
        """Limits of parity --artifact that this artifact's weights loosen (parity.ARTIFACT_THRESHOLDS otherwise)."""
        return {}

    def rounds_activations(self, manifest: dict) -> bool:
        """Whether the artifact's matmuls quantize their activations on the fly: rounding is a step function, so
        float differences upstream flip codes and compound over the layers, and parity --artifact judges its logits
        on the probability scale only (parity.distribution_parity)."""
        return False

    def decode_profile(self, directory: Path, manifest: dict, runtime: str, ids: list[int], steps: int,
                       threads: int) -> dict | None:
        """Where a decode step goes on `runtime` after prefilling `ids`: {"step_wall_ms", "ops": {op type:
        {"ms", "nodes_per_step"}}, "other_ms": {what: ms}}; None where no profiler is wired for it."""
        return None

    def unavailable_runtimes(self) -> dict[str, str]:
        """Runtimes of this target that cannot run here: name -> why."""
        return {}

    def trace(self, directory: Path, manifest: dict, runtime: str, ids: list[int], steps: int,
              forced: list[int] | None = None) -> dict:
        """Greedy tokens, each step's logits and the packed body codes by cache name (parity.py); or
        {"skipped": why} when this runtime cannot be given this prompt. forced: the reference's tokens, fed
        instead of the runtime's own (GreedyLM.trace); "forced" in the result says whether they were."""
        runner = self.runner(directory, manifest, runtime, 0)
        tokens, logits = runner.trace(ids, steps, manifest["eos_token_ids"], forced)
        return {"tokens": tokens, "logits": logits, "codes": runner.body_codes(), "forced": forced is not None}


_REGISTRY: dict[str, Target] = {}


def register(target: Target) -> Target:
    if target.name in _REGISTRY:
        raise ValueError(f"target {target.name!r} is registered twice")
    _REGISTRY[target.name] = target
    return target


def registry() -> dict[str, Target]:
    """Every target, by name: the packages in this folder register themselves when imported (importing is
    idempotent, so a package imported directly before this call is not registered twice)."""
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")
    return _REGISTRY


def names() -> tuple[str, ...]:
    return tuple(sorted(registry()))


def get(name: str) -> Target:
    targets = registry()
    if name not in targets:
        raise OscarInputError(f"target {name!r}: expected one of {names()}")
    return targets[name]
