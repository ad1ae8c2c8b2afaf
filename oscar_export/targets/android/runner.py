"""Run an exported android model on this machine with ExecuTorch.

runtime="executorch": the .pte through the pybindings (executorch.extension.pybindings), one
forward call per prefill chunk or decode step; the packed cache stays in the program's mutable
buffers between calls. runtime="stock-runner": the same .pte through ExecuTorch's C++ LLM runner
(TextLLMRunner, what Android apps use), which reads the program's metadata methods and the
tokenizer.json itself. Both need the oscar::attention kernel: liboscar_executorch.so is loaded
into the process (RTLD_GLOBAL) first, registering it in the ExecuTorch runtime they share.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ...config import OscarInputError
from ...export.artifact import GreedyLM, artifact_tokenizer
from .lower import LIBRARY_FILE, MODEL_FILE
from ...ops.attention import CACHE_NAMES

RUNTIMES = ("executorch", "stock-runner")
TOKENIZER_FILE = "tokenizer.json"
OP = "oscar::attention.out"
_SCALAR_TYPES = {0: "uint8", 4: "int64", 5: "float16", 6: "float32"}  # ExecuTorch's ScalarType codes
_loaded: dict[str, ctypes.CDLL] = {}  # one kernel library per process: a second would register the op twice


def load_kernels(library=None) -> ctypes.CDLL:
    """Load liboscar_executorch.so (default: the one this checkout builds) into the ExecuTorch runtime, once."""
    from executorch.extension.pybindings import portable_lib  # loads libexecutorch.so, whose registry we join

    if "kernels" in _loaded:
        return _loaded["kernels"]
    if library is None:
        from ...native import executorch_library_path

        library = executorch_library_path()
    from ...native import executorch_dir, probe_library

    root, _ = executorch_dir()
    probe_library(library, preload=(root / "lib" / "libexecutorch.so",) if root is not None else ())
    lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    lib.oscar_executorch_last_error.restype = ctypes.c_char_p
    if OP not in portable_lib._get_operator_names():
        raise RuntimeError(f"{library} loaded but {OP} is not registered: expected a library built against "
                           "this executorch wheel's libexecutorch.so")
    _loaded["kernels"] = lib
    return lib


def load_executorch_llm_ops() -> None:
    """ExecuTorch's llama:: cache and SDPA ops and the quantize ops of its int8 cache, for export (their out
    variants), eager runs and the runtime (their kernels): what the benchmarks' baselines run."""
    importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")
    importlib.import_module("executorch.kernels.quantized")


def set_threads(threads: int) -> None:
    """ExecuTorch's thread pool and the OSCAR kernel's workers both at `threads` (the kernel would otherwise use
    every core whatever the pool's size). A kernel library from before the cap existed keeps every core."""
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(threads)
    cap = getattr(_loaded["kernels"], "oscar_executorch_set_threads", None)
    if cap is not None:
        cap(ctypes.c_int32(threads))


def kernel_error() -> str:
    """The message of the last failed oscar::attention call on this thread ('' if none or not loaded)."""
    lib = _loaded.get("kernels")
    return lib.oscar_executorch_last_error().decode() if lib is not None else ""


def load_program(path):
    """The program through the pybindings; a clear error when the OSCAR kernel is missing. Keep the
    returned program alive as long as any method loaded from it."""
    from executorch.extension.pybindings import portable_lib

    path = Path(path)
    if not path.is_file():
        raise OscarInputError(f"{path}: no such file: expected an android artifact's {MODEL_FILE}")
    if OP not in portable_lib._get_operator_names():
        raise OscarInputError(f"{path.name} calls {OP}, which this ExecuTorch runtime does not have: load "
                              f"{LIBRARY_FILE} first (ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL), or "
                              "oscar_export.targets.android.runner.load_kernels())")
    with open(path, "rb") as f:  # ExecuTorch's loader aborts the process on a file that is not a program
        if f.read(8)[4:8] != b"ET12":
            raise OscarInputError(f"{path}: not an ExecuTorch program (no ET12 header): expected the {MODEL_FILE} "
                                  f"an android export writes")
    try:
        # InternalConsistency: the flatbuffer is verified before use, so a damaged program is an error, not a
        # read past its buffers.
        return portable_lib._load_program(str(path), program_verification=portable_lib.Verification.InternalConsistency)
    except RuntimeError as err:
        raise OscarInputError(f"{path}: ExecuTorch cannot load it ({str(err).splitlines()[0]}): re-export") from None


def program_io(directory) -> list[tuple[str, dict, int, int]]:
    """Target.program_io of an android artifact: forward's mutable cache buffers (in the op's order, layer by
    layer), its logits width and its longest chunk, from the program's method metadata."""
    directory = Path(directory)
    load_kernels(directory / LIBRARY_FILE if (directory / LIBRARY_FILE).is_file() else None)
    try:
        meta = load_program(directory / MODEL_FILE).method_meta("forward")
    except RuntimeError as err:
        raise OscarInputError(f"{directory / MODEL_FILE}: ExecuTorch cannot read its forward method "
                              f"({str(err).splitlines()[0][:200]}): re-export") from None
    count = meta.num_attributes()
    names = [f"layer{i // len(CACHE_NAMES)}.{CACHE_NAMES[i % len(CACHE_NAMES)]}" for i in range(count)]
    layout = {}
    for name, i in zip(names, range(count)):
        tensor = meta.attribute_tensor_meta(i)
        layout[name] = (tuple(tensor.sizes()), _SCALAR_TYPES.get(int(tensor.dtype()), f"type {int(tensor.dtype())}"))
    return [(MODEL_FILE, layout, meta.output_tensor_meta(0).sizes()[-1], meta.input_tensor_meta(0).sizes()[-1])]


class EtLM(GreedyLM):
    """One sequence through an exported .pte; `length` tokens are cached in its mutable buffers."""

    def __init__(self, directory, threads: int = 0, max_chunk: int = 256, library=None):
        directory = Path(directory)
        if library is None and (directory / LIBRARY_FILE).is_file():
            library = directory / LIBRARY_FILE
        load_kernels(library)
        if threads:
            set_threads(threads)
        self.program = load_program(directory / MODEL_FILE)
        try:
            self.method = self.program.load_method("forward")
            self.max_context = int(self.program.load_method("get_max_context_len")([])[0])
        except RuntimeError as err:  # a program whose header parses but whose methods do not
            raise OscarInputError(f"{directory / MODEL_FILE}: ExecuTorch cannot load its methods "
                                  f"({str(err).splitlines()[0][:200]}): re-export") from None
        layers = self.method.method_meta().num_attributes() // len(CACHE_NAMES)
        self.cache_names = [f"cache.{i}.{name}" for i in range(layers) for name in CACHE_NAMES]
        self.max_chunk, self.length = max_chunk, 0

    def step(self, ids) -> np.ndarray:
        """Run one chunk of token ids (at most max_chunk); returns the last position's logits [vocab]."""
        ids = torch.tensor(np.asarray(ids, dtype=np.int64).reshape(1, -1))
        if self.length + ids.shape[1] > self.max_context:
            raise OscarInputError(f"cache capacity exceeded: {self.length} + {ids.shape[1]} tokens > "
                                  f"max_context={self.max_context}: expected a shorter prompt or a larger --context")
        try:
            (logits,) = self.method([ids, torch.tensor([self.length], dtype=torch.int64)])
        except RuntimeError as err:  # the kernel's own message where it refused its inputs
            raise OscarInputError(f"{MODEL_FILE}: ExecuTorch failed running it ("
                                  f"{f'oscar::attention: {kernel_error()}' if kernel_error() else str(err)}): the "
                                  "program is damaged; re-export") from None
        self.length += ids.shape[1]
        return logits.numpy()[0, -1]

    def cache_arrays(self) -> dict[str, np.ndarray]:
        """The cache as it is now, by buffer name (cache.{layer}.k_codes ...)."""
        return {name: self.method.get_attribute(name).numpy().copy() for name in self.cache_names}

    def writable_cache(self) -> dict[str, np.ndarray]:
        # get_attribute aliases the program's mutable buffers: writing its arrays writes the cache the op reads.
        return {"layer" + name[len("cache."):]: self.method.get_attribute(name).numpy() for name in self.cache_names}

    def body_codes(self) -> dict[str, np.ndarray]:
        return {"layer" + name[len("cache."):]: array for name, array in self.cache_arrays().items()
                if name.endswith("_codes")}


@contextlib.contextmanager
def _stdout_to_stderr():
    """The C++ runner prints each piece to stdout: keep it off this process's stdout (JSON goes there)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def piece_ids(tokenizer, pieces: list[str]) -> list[int | None]:
    """Token ids of the runner's text pieces (one piece per generated token); None where a piece is the
    decoding of more than one id, so the id cannot be recovered from the text."""
    by_text: dict[str, list[int]] = {}
    for i in range(len(tokenizer)):
        by_text.setdefault(tokenizer.decode([i]), []).append(i)
    return [ids[0] if len(ids := by_text.get(p, [])) == 1 else None for p in pieces]


def stock_runner_generate(directory, prompt: str, max_new_tokens: int, threads: int = 0) -> dict:
    """Greedy generation by ExecuTorch's TextLLMRunner, which tokenizes the prompt itself:
    {"tokens": [...] (ids recovered from the pieces), "text": "..."}."""
    directory = Path(directory)
    library = directory / LIBRARY_FILE
    load_kernels(library if library.is_file() else None)
    if threads:
        set_threads(threads)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    for name in (MODEL_FILE, TOKENIZER_FILE):
        if not (directory / name).is_file():
            raise OscarInputError(f"artifact {str(directory)!r} has no {name}: expected an android export directory")
    try:
        runner = TextLLMRunner(str(directory / MODEL_FILE), str(directory / TOKENIZER_FILE))
    except RuntimeError as err:
        raise OscarInputError(f"{directory / MODEL_FILE}: ExecuTorch's runner cannot load it with {TOKENIZER_FILE} "
                              f"({str(err).splitlines()[0][:200]}): re-export") from None
    pieces: list[str] = []
    config = GenerationConfig(echo=False, max_new_tokens=max_new_tokens, temperature=0.0)
    with _stdout_to_stderr():
        try:
            runner.generate(prompt, config, token_callback=pieces.append)
        except RuntimeError as err:  # its own checks (the context, the program's methods) say only "failed"
            raise OscarInputError(f"{directory / MODEL_FILE}: ExecuTorch's runner stopped after {len(pieces)} "
                                  f"tokens ({str(err).splitlines()[0][:200]}; its log above says why)") from None
    tokenizer = artifact_tokenizer(directory)
    return {"tokens": piece_ids(tokenizer, pieces), "text": "".join(pieces)}
