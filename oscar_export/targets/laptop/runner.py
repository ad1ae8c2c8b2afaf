"""Run an exported laptop model with ONNX Runtime: prefill the prompt, then decode greedily.

runtime="onnxruntime" loads model.onnx with the native op library. The cache is one set of
numpy buffers per layer, bound once as OrtValues over their memory: the op appends to them in
place, so a step copies nothing. runtime="onnx-fallback" loads model_fallback.onnx in a stock
ONNX Runtime; its graph returns the updated buffers, which are bound as the next run's inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...config import OscarInputError
from ...export.artifact import GreedyLM
from .lower import FALLBACK_FILE, LIBRARY_FILE, MODEL_FILE

RUNTIMES = ("onnxruntime", "onnx-fallback")
_ELEMENT_TYPES = {1: "float32", 2: "uint8", 7: "int64", 10: "float16"}  # onnx.TensorProto's data types
_DTYPES = {"tensor(float16)": np.float16, "tensor(uint8)": np.uint8, "tensor(float)": np.float32}


class OrtLM(GreedyLM):
    """One sequence through an exported model; `length` tokens are cached."""

    def __init__(self, directory, runtime: str = "onnxruntime", threads: int = 0, max_chunk: int = 512,
                 library=None, profile_prefix: str | None = None):
        if runtime not in RUNTIMES:
            raise OscarInputError(f"runtime={runtime!r}: expected one of {RUNTIMES}")
        directory = Path(directory)
        self.native, self.max_chunk = runtime == "onnxruntime", max_chunk
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        if profile_prefix:  # ONNX Runtime's profiler (profile.py reads it)
            options.enable_profiling, options.profile_file_prefix = True, profile_prefix
        if self.native:
            if library is None:
                library = directory / LIBRARY_FILE
                if not library.is_file():
                    from ...native import ort_library_path

                    library = ort_library_path()
            from ...native import probe_library

            probe_library(library)
            try:
                options.register_custom_ops_library(str(library))
            except Exception as err:  # onnxruntime raises its own Fail/RuntimeException types
                raise OscarInputError(f"{library}: ONNX Runtime cannot load this op library "
                                      f"({str(err).splitlines()[0]}): re-export, or use --runtime onnx-fallback") \
                    from None
        else:
            print("onnx-fallback: OscarAttention runs as a pure-ONNX function without the native library: slower, "
                  "and every step copies the whole cache", file=sys.stderr)
        path = self.path = directory / (MODEL_FILE if self.native else FALLBACK_FILE)
        if not path.is_file():
            raise OscarInputError(f"artifact {str(directory)!r} has no {path.name}: expected an export directory")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # a damaged model or external data file
            raise OscarInputError(f"{path}: ONNX Runtime cannot load it ({str(err).splitlines()[0][:300]}): "
                                  f"re-export") from None
        cache_inputs = self.session.get_inputs()[2:]
        self.cache_names = [i.name for i in cache_inputs]
        # Zeros are fine: the op only reads the `length` tokens it wrote.
        self.cache = {i.name: np.zeros(i.shape, _DTYPES[i.type]) for i in cache_inputs}
        first = self.cache_names[0].split(".")[0]
        self.max_context = sum(self.cache[f"{first}.{region}"].shape[1] for region in ("k_sink", "k_recent", "k_codes"))
        self.length = 0
        self.binding = self.session.io_binding()
        for name, array in self.cache.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        self._values = None  # fallback: the OrtValues that now hold the cache

    def step(self, ids) -> np.ndarray:
        """Run one chunk of token ids (at most max_chunk); returns the last position's logits [vocab]."""
        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(1, -1))
        if self.length + ids.shape[1] > self.max_context:
            raise OscarInputError(f"cache capacity exceeded: {self.length} + {ids.shape[1]} tokens > "
                                  f"max_context={self.max_context}: expected a shorter prompt or a larger --context")
        length = np.array([self.length], np.int64)
        self.binding.bind_cpu_input("input_ids", ids)
        self.binding.bind_cpu_input("length", length)
        self.binding.bind_output("logits", "cpu")
        if not self.native:
            for name in self.cache_names:
                self.binding.bind_output(f"{name}.next", "cpu")
        try:
            self.session.run_with_iobinding(self.binding)
        except Exception as err:  # onnxruntime's own Fail/RuntimeException types: a program it loaded but cannot run
            raise OscarInputError(f"{self.path.name}: ONNX Runtime failed running it ({str(err).splitlines()[0][:300]}): "
                                  "the program is damaged; re-export") from None
        outputs = self.binding.get_outputs()
        if not self.native:
            self._values = outputs[1:]
            for name, value in zip(self.cache_names, self._values):
                self.binding.bind_ortvalue_input(name, value)
        self.length += ids.shape[1]
        return outputs[0].numpy()[0, -1]

    def writable_cache(self) -> dict[str, np.ndarray]:
        if self._values is not None:
            raise OscarInputError("a synthetic cache state: expected a fresh runner, before any step")
        return self.cache

    def cache_arrays(self) -> dict[str, np.ndarray]:
        """The cache as it is now, by input name (layer{i}.k_codes ...)."""
        if self.native or self._values is None:
            return self.cache
        return {name: value.numpy() for name, value in zip(self.cache_names, self._values)}


def program_io(directory) -> list[tuple[str, dict, int | None, None]]:
    """Target.program_io of a laptop artifact: each graph's cache inputs and logits width (ONNX Runtime takes any
    chunk length), read from the graphs without their weights."""
    import onnx

    out = []
    for name in (MODEL_FILE, FALLBACK_FILE):
        path = Path(directory) / name
        try:
            graph = onnx.load(path, load_external_data=False).graph
        except Exception as err:  # protobuf's DecodeError and its relatives
            raise OscarInputError(f"{path}: not an ONNX model ({str(err).splitlines()[0][:200]}): re-export") from None
        layout = {}
        for value in graph.input[2:]:
            tensor = value.type.tensor_type
            layout[value.name] = (tuple(dim.dim_value for dim in tensor.shape.dim),
                                  _ELEMENT_TYPES.get(tensor.elem_type, f"type {tensor.elem_type}"))
        dims = graph.output[0].type.tensor_type.shape.dim if graph.output else ()
        out.append((name, layout, dims[-1].dim_value if dims else 0, None))
    return out
