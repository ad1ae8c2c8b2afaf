"""An installed oscar-export (a wheel, outside the checkout) carries the native sources and builds them into a
per-user cache; a checkout builds runtime_ops/ into build/ (setup.py, oscar_export/native.py).
scripts/wheel_test.sh installs a real wheel and runs the CLI; these checks are the fast part."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oscar_export import native

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def build_lib(tmp_path_factory) -> Path:
    """The package as setup.py's build_py lays it out for a wheel."""
    lib = tmp_path_factory.mktemp("wheel") / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=REPO, check=True,
                   capture_output=True)
    return lib


def test_wheel_ships_every_runtime_ops_file(build_lib):
    shipped = build_lib / "oscar_export" / "runtime_ops"
    sources = [p for p in (REPO / "runtime_ops").rglob("*") if p.is_file()]
    assert sources and any(p.name == "CMakeLists.txt" for p in sources)
    for path in sources:
        copy = shipped / path.relative_to(REPO / "runtime_ops")
        assert copy.is_file() and copy.read_bytes() == path.read_bytes(), copy


def test_installed_package_builds_its_shipped_sources_into_the_cache(build_lib, tmp_path):
    code = ("import json, oscar_export.native as n; "
            "print(json.dumps([n.__file__, n.CHECKOUT, str(n.SOURCES), str(n.build_root())]))")
    env = {**os.environ, "PYTHONPATH": str(build_lib), "OSCAR_EXPORT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    module, checkout, sources, root = json.loads(proc.stdout.splitlines()[-1])
    assert Path(module).is_relative_to(build_lib)  # not the checkout's copy
    assert not checkout
    assert Path(sources) == build_lib / "oscar_export" / "runtime_ops"
    assert (Path(sources) / "CMakeLists.txt").is_file()
    assert Path(root) == tmp_path / "cache"


def test_checkout_builds_into_the_repository():
    assert native.CHECKOUT
    assert native.SOURCES == REPO / "runtime_ops"
    assert native.build_root() == REPO / "build"


def test_cache_outside_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "CHECKOUT", False)
    monkeypatch.setenv("OSCAR_EXPORT_CACHE", str(tmp_path / "mine"))
    assert native.build_root() == tmp_path / "mine"
    monkeypatch.delenv("OSCAR_EXPORT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.build_root() == tmp_path / "xdg" / "oscar-export"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.build_root() == tmp_path / "home" / ".cache" / "oscar-export"


def test_ort_headers_are_fetched_into_the_cache(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, what, env=None):
        seen.update(env)
        return f"{tmp_path}/include\n"

    monkeypatch.setattr(native, "CHECKOUT", False)
    monkeypatch.setattr(native, "_run", fake_run)
    monkeypatch.setenv("OSCAR_EXPORT_CACHE", str(tmp_path))
    monkeypatch.delenv("ORT_HEADERS_DEST", raising=False)
    assert native.ort_include_dir.__wrapped__() == (tmp_path / "include", "")
    assert seen["ORT_HEADERS_DEST"] == str(tmp_path / "ort-headers")


@pytest.mark.parametrize("missing, message", [({"cmake"}, "cmake not found"),
                                              ({"g++", "c++", "clang++"}, "no C\\+\\+ compiler found")])
def test_missing_build_tools_are_named(monkeypatch, missing, message):
    real = native.shutil.which
    monkeypatch.setattr(native.shutil, "which", lambda name: None if name in missing else real(name))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match=message):
        native.build_native()


@pytest.mark.parametrize("configured_for, kept", [("other", False), ("same", True)])
def test_cache_configured_for_other_sources_is_reconfigured(monkeypatch, tmp_path, configured_for, kept):
    """An install sharing the cache with another one: CMake refuses a cache made for other sources."""
    calls = []
    monkeypatch.setattr(native, "_run", lambda cmd, what, env=None: calls.append(cmd) or "")
    monkeypatch.setattr(native.shutil, "which", lambda name: f"/usr/bin/{name}")
    sources = str(native.SOURCES) if configured_for == "same" else "/elsewhere/runtime_ops"
    (tmp_path / "CMakeCache.txt").write_text("")
    (tmp_path / ".oscar-configure").write_text(f"{sources}\n-DOSCAR_SANITIZE=OFF")
    native.build_native(tmp_path, sanitize=True)  # sanitize: no ONNX Runtime header fetch
    assert (tmp_path / "CMakeCache.txt").is_file() == kept
    assert calls[0][:3] == ["/usr/bin/cmake", "-S", str(native.SOURCES)]
    assert (tmp_path / ".oscar-configure").read_text().splitlines()[:2] == [str(native.SOURCES),
                                                                          "-DOSCAR_SANITIZE=ON"]
