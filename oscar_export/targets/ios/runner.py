"""Run a converted ios model: the host loop an app runs, in Python.

The host keeps one set of cache buffers per layer (numpy arrays in the model's input layout),
feeds them with each chunk, and writes the rows the model returns into them by the placement rule
(ops/coreml.py apply_rows). runtime "coreml-mil" executes the converted MIL program in numpy
(mil_eval.py, any OS); "coreml" calls MLModel.predict (macOS only).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np

from ...config import OscarInputError
from ...export.artifact import MANIFEST, GreedyLM, manifest_cache_layout
from ...ops.coreml import ROW_NAMES, apply_rows, fp8_word_count
from ...ops.attention import CACHE_NAMES

RUNTIMES = ("coreml-mil", "coreml")


def coreml_available() -> tuple[bool, str]:
    """(whether MLModel.predict can run here, why not)."""
    if platform.system() != "Darwin":
        return False, f"Core ML runs models only on macOS (this is {platform.system()})"
    try:
        from coremltools import libcoremlpython  # noqa: F401
    except ImportError as err:
        return False, f"coremltools has no Core ML bindings here ({err})"
    return True, ""


class CoreMLLM(GreedyLM):
    """One sequence through a converted model; `length` tokens are cached.

    model: a coremltools MLModel (from conversion, or loaded from the artifact's .mlpackage).
    """

    def __init__(self, model, runtime: str, layers: int, sink: int, recent: int, max_chunk: int):
        if runtime not in RUNTIMES:
            raise OscarInputError(f"runtime={runtime!r}: expected one of {RUNTIMES}")
        self.runtime, self.layers, self.sink, self.recent, self.max_chunk = runtime, layers, sink, recent, max_chunk
        if runtime == "coreml-mil":
            from .mil_eval import MilProgram, saved_program

            try:
                self._program = MilProgram(saved_program(model))
            except (RuntimeError, ValueError) as err:  # the weight file's reader on a damaged blob
                raise OscarInputError(f"the Core ML program's weights cannot be read ({str(err).splitlines()[0][:200]}):"
                                      " the artifact is damaged; re-export") from None
            layout = dict(self._program.inputs)
            self._predict = self._program.run
        else:
            ok, why = coreml_available()
            if not ok:
                raise OscarInputError(f"--runtime coreml: {why}: expected macOS, or --runtime coreml-mil")
            layout = {}
            for feature in model.get_spec().description.input:
                array = feature.type.multiArrayType
                dtype = {65568: np.float32, 65552: np.float16, 131104: np.int32}[array.dataType]
                layout[feature.name] = (tuple(array.shape), dtype)
            self._predict = model.predict
        self.cache = {name: np.zeros(shape, dtype) for name, (shape, dtype) in layout.items()
                      if name not in ("input_ids", "length")}
        self.max_context = sum(self.cache[f"layer0_k_{region}"].shape[1] for region in ("sink", "recent", "codes"))
        self.length = 0

    def step(self, ids) -> np.ndarray:
        """Run one chunk (at most max_chunk tokens); returns the last position's logits [vocab]."""
        ids = np.asarray(ids, dtype=np.int32).reshape(1, -1)
        if not 1 <= ids.shape[1] <= self.max_chunk:
            raise OscarInputError(f"chunk of {ids.shape[1]} tokens: expected 1 .. {self.max_chunk}")
        if self.length + ids.shape[1] > self.max_context:
            raise OscarInputError(f"cache capacity exceeded: {self.length} + {ids.shape[1]} tokens > "
                                  f"max_context={self.max_context}: expected a shorter prompt or a larger --context")
        out = self._predict({"input_ids": ids, "length": np.array([self.length], np.int32), **self.cache})
        for i in range(self.layers):
            layer = {name: self.cache[f"layer{i}_{name}"] for name in CACHE_NAMES}
            apply_rows(layer, {name: out[f"layer{i}_{name}"] for name in ROW_NAMES}, self.length, self.sink,
                       self.recent)
        self.length += ids.shape[1]
        return np.asarray(out["logits"], np.float32)[0, -1]

    def body_codes(self) -> dict[str, np.ndarray]:
        """Packed body codes as the format's bytes (uint8) by cache name (layer{i}.k_codes): the int32 words
        are those bytes."""
        return {name.replace("_", ".", 1): np.ascontiguousarray(array).view(np.uint8)
                for name, array in self.cache.items() if name.endswith("_codes")}


_ARRAY_TYPES = {65568: "float32", 65552: "float16", 131104: "int32"}  # Core ML's ArrayDataType codes


def program_io(directory) -> list[tuple[str, dict, int | None, int]]:
    """Target.program_io of an ios artifact: the model's cache inputs (code words read as the format's bytes), its
    logits width where the description states it, and the longest chunk its input_ids take.

    fp8 scale and zero words hold [H, B, G] bytes flattened: the manifest's B and G read them where the word count
    agrees, and a count that does not is reported as the program declares it."""
    from .lower import MODEL_FILE

    spec = load(directory).get_spec()
    manifest = json.loads((Path(directory) / MANIFEST).read_text())
    declared = {name: shape for name, shape, dtype in manifest_cache_layout(manifest)
                if dtype == "uint8" and not name.endswith("_codes")}
    layout, max_chunk = {}, 0
    for feature in spec.description.input:
        array = feature.type.multiArrayType
        shape, dtype = tuple(int(n) for n in array.shape), _ARRAY_TYPES.get(array.dataType, f"type {array.dataType}")
        if feature.name == "input_ids":
            ranges = array.shapeRange.sizeRanges
            max_chunk = int(ranges[-1].upperBound) if ranges else shape[-1]
        elif feature.name != "length":
            name = feature.name.replace("_", ".", 1)
            if feature.name.endswith("_codes") and dtype == "int32":  # int32 words hold the format's bytes
                shape, dtype = (*shape[:-1], shape[-1] * 4), "uint8"
            elif name in declared and dtype == "int32" and shape == (declared[name][0],
                                                                     fp8_word_count(*declared[name][1:])):
                shape, dtype = declared[name], "uint8"
            layout[name] = (shape, dtype)
    logits = [f.type.multiArrayType.shape for f in spec.description.output if f.name == "logits"]
    return [(MODEL_FILE, layout, int(logits[0][-1]) if logits and logits[0] else None, max_chunk)]


def load(directory):
    """The artifact's MLModel, without compiling it (compiling needs macOS)."""
    import coremltools as ct

    from .lower import MODEL_FILE

    path = Path(directory) / MODEL_FILE
    if not path.is_dir():
        raise OscarInputError(f"artifact {str(directory)!r} has no {MODEL_FILE}: expected an ios export directory")
    try:
        return ct.models.MLModel(str(path), skip_model_load=not coreml_available()[0])
    except Exception as err:  # protobuf's DecodeError, the package manifest's JSON parser, ...: a damaged package
        raise OscarInputError(f"{path}: Core ML cannot read it ({str(err).splitlines()[0][:200]}): re-export") from None
