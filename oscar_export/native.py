"""Build the native kernels in runtime_ops/ (C++ core, ONNX Runtime and ExecuTorch op libraries) with CMake.

The sources are the repository's runtime_ops/ in a source checkout, else the copy an installed
package ships as oscar_export/runtime_ops/ (setup.py). build_native() configures and builds into
build_root()/native[-asan|-aarch64]: build/ at the repository root, else a per-user cache
($OSCAR_EXPORT_CACHE, $XDG_CACHE_HOME/oscar-export or ~/.cache/oscar-export). A second call with
nothing changed only asks the build tool, which returns at once. The ONNX Runtime library needs
the ORT C/C++ headers, which the pip wheel lacks: runtime_ops/onnxruntime/fetch_ort_headers.sh
fetches them into build_root()/ort-headers (or honours ORT_INCLUDE_DIR). The ExecuTorch library
builds against the installed executorch wheel's headers and libexecutorch.so.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from .calibration.cached import cache_dir
from .config import OscarInputError

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent  # the repository in a source checkout; site-packages when installed
CHECKOUT = (ROOT / "runtime_ops" / "CMakeLists.txt").is_file()
SOURCES = ROOT / "runtime_ops" if CHECKOUT else PACKAGE / "runtime_ops"
TARGETS = (None, "aarch64")
BUILD_JOBS = "2"  # the build shares small machines; more jobs buy little for five files
ORT_LIBRARY = "liboscar_ort.so"
EXECUTORCH_LIBRARY = "liboscar_executorch.so"
EXECUTORCH_INVOKE = "liboscar_et_invoke.so"  # test hook: calls the registered kernel on raw buffers
CORE_LIBRARY = "liboscar_core_c.so"
CORE_TEST = "oscar_core_test"


def build_root() -> Path:
    """The folder that holds the native build directories (native, native-asan, native-aarch64) and the
    fetched ONNX Runtime headers: <repository>/build in a source checkout, else the per-user cache the
    calibrations use (an installed package's folder may be read-only and is shared by every user)."""
    return ROOT / "build" if CHECKOUT else cache_dir()


def _run(cmd: list[str], what: str, env: dict | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-30:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))
    return proc.stdout


@functools.lru_cache(maxsize=None)
def ort_include_dir() -> tuple[Path | None, str]:
    """(ONNX Runtime include directory, "") or (None, why it is unavailable); asked once per process."""
    script = SOURCES / "onnxruntime" / "fetch_ort_headers.sh"
    # The script's own default (next to the sources) is inside the package when installed.
    env = {**os.environ, "ORT_HEADERS_DEST": os.environ.get("ORT_HEADERS_DEST") or str(build_root() / "ort-headers")}
    try:
        out = _run(["bash", str(script)], "fetching the ONNX Runtime headers", env)
    except RuntimeError as exc:
        return None, f"{exc}\nSet ORT_INCLUDE_DIR to a directory holding onnxruntime_c_api.h to skip the fetch."
    return Path(out.strip().splitlines()[-1]), ""


def ort_op_buildable() -> bool:
    """Whether liboscar_ort.so can be built here: cmake, g++ and the ONNX Runtime headers."""
    return shutil.which("cmake") is not None and shutil.which("g++") is not None and ort_include_dir()[0] is not None


def executorch_dir() -> tuple[Path | None, str]:
    """(the installed executorch package, "") or (None, why the ExecuTorch library cannot be built)."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        return None, "the executorch package is not installed (pip install -e '.[android]')"
    root = Path(list(spec.submodule_search_locations)[0])
    if not (root / "lib" / "libexecutorch.so").is_file() or not (root / "include" / "executorch").is_dir():
        return None, f"{root} has no lib/libexecutorch.so or include/executorch: expected an executorch wheel >= 1.0"
    return root, ""


_PROBE = "import ctypes, sys\nfor path in sys.argv[1:]:\n    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)\n"


def probe_library(path, preload: tuple = ()) -> None:
    """Load a shared library in a throwaway process first: a damaged one that would crash the dynamic loader
    (which no check in this process survives) becomes an error naming the file."""
    import sys

    try:
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE, *map(str, preload), str(path)],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise OscarInputError(f"{path}: loading this library hangs: expected an op library written by "
                              f"oscar-export; re-export") from None
    if proc.returncode < 0:
        raise OscarInputError(f"{path}: this library crashes the loader (signal {-proc.returncode}): the file is "
                              f"damaged; re-export")
    if proc.returncode:
        reason = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise OscarInputError(f"{path}: cannot load this library ({reason[:300]}): re-export")


def build_native(build_dir: str | Path | None = None, sanitize: bool = False, target: str | None = None) -> Path:
    """Configure and build runtime_ops/ and return the build directory.

    sanitize: AddressSanitizer + UndefinedBehaviorSanitizer build (core, C API, test executable).
    target: None for this machine (adds liboscar_ort.so when ORT headers are available and
    liboscar_executorch.so when the executorch wheel is installed; sanitize builds include the latter), or
    "aarch64" to cross-compile with aarch64-linux-gnu-g++ (run the test binary under qemu-aarch64).
    """
    if target not in TARGETS:
        raise OscarInputError(f"target={target!r}: expected one of {TARGETS}")
    if not (SOURCES / "CMakeLists.txt").is_file():
        raise RuntimeError(f"native sources not found at {SOURCES}: expected a source checkout of oscar-export "
                           "or an installed wheel that ships oscar_export/runtime_ops/; reinstall oscar-export")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake not found on PATH: install cmake >= 3.16 and a C++17 compiler (Debian: cmake g++)")
    if target is None and not os.environ.get("CXX") and not any(map(shutil.which, ("g++", "c++", "clang++"))):
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++ on PATH, or $CXX): install a C++17 compiler "
                           "(Debian: g++)")
    suffix = ("-asan" if sanitize else "") + (f"-{target}" if target else "")
    build_dir = Path(build_dir) if build_dir is not None else build_root() / f"native{suffix}"

    args = [f"-DOSCAR_SANITIZE={'ON' if sanitize else 'OFF'}"]
    if target == "aarch64":
        if shutil.which("aarch64-linux-gnu-g++") is None:
            raise RuntimeError("aarch64-linux-gnu-g++ not found: install the Debian package g++-aarch64-linux-gnu")
        args.append(f"-DCMAKE_TOOLCHAIN_FILE={SOURCES / 'cmake' / 'aarch64-linux-gnu.cmake'}")
    else:
        if not sanitize:
            include, _ = ort_include_dir()
            args.append(f"-DORT_INCLUDE_DIR={include or ''}")
        et_root, _ = executorch_dir()
        args.append(f"-DEXECUTORCH_DIR={et_root or ''}")
    if shutil.which("ninja"):
        args.append("-GNinja")

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:  # other test processes may build the same directory
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = build_dir / ".oscar-configure"
        wanted = "\n".join([str(SOURCES), *args])
        done = stamp.read_text() if stamp.is_file() else ""
        if not (build_dir / "CMakeCache.txt").is_file() or done != wanted:
            if done.split("\n", 1)[0] != str(SOURCES):
                # CMake refuses a build directory configured for other sources (another install sharing the cache).
                (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
            _run([cmake, "-S", str(SOURCES), "-B", str(build_dir), *args], "cmake configure")
            stamp.write_text(wanted)
        _run([cmake, "--build", str(build_dir), "-j", BUILD_JOBS], "cmake build")
    return build_dir


def core_library_path(build_dir: str | Path | None = None) -> Path:
    """liboscar_core_c.so (the C ABI of oscar_c_api.h), built if needed."""
    return build_native(build_dir) / CORE_LIBRARY


def simd_kernels(build_dir: str | Path | None = None) -> dict | None:
    """{"decode": the fused kernel set decode steps run here ("" if none), "available": every set this CPU runs,
    fastest first}, asked of the built core; None when it is not built yet. OSCAR_SIMD picks another set."""
    import ctypes

    path = Path(build_dir or build_root() / "native") / CORE_LIBRARY
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    for name in ("oscar_simd_kernel_name", "oscar_simd_kernel_sets"):
        getattr(lib, name).restype = ctypes.c_char_p
    return {"decode": lib.oscar_simd_kernel_name().decode(),
            "available": [s for s in lib.oscar_simd_kernel_sets().decode().split(",") if s]}


def ort_library_path(build_dir: str | Path | None = None) -> Path:
    """liboscar_ort.so for SessionOptions.register_custom_ops_library, built if needed."""
    path = build_native(build_dir) / ORT_LIBRARY
    if not path.is_file():
        _, why = ort_include_dir()
        raise RuntimeError(f"{ORT_LIBRARY} was not built: the ONNX Runtime headers are unavailable.\n{why}")
    return path



def executorch_library_path(build_dir: str | Path | None = None, sanitize: bool = False) -> Path:
    """liboscar_executorch.so (the oscar::attention.out kernel) to load before a program, built if needed."""
    root, why = executorch_dir()
    if root is None:
        raise RuntimeError(f"{EXECUTORCH_LIBRARY} cannot be built: {why}")
    path = build_native(build_dir, sanitize=sanitize) / EXECUTORCH_LIBRARY
    if not path.is_file():
        raise RuntimeError(f"{EXECUTORCH_LIBRARY} was not built in {path.parent}")
    return path
