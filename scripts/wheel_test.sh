#!/usr/bin/env bash
# CI: oscar-export installed from a wheel works outside the source checkout. Builds the sdist and from it
# the wheel (so MANIFEST.in is tested too, and no stale build/ of the checkout leaks in), installs the
# wheel into a fresh venv in a temporary folder, and from there builds the native op library from the
# shipped runtime_ops/ and runs info, plan, a laptop export and a run. The dependencies are .venv's,
# not reinstalled. One line per step; a failed step prints its output's tail and the script exits non-zero.
source "$(dirname "$0")/venv.sh"  # .venv with the dependencies; sets ROOT and cd's there
PY="$ROOT/.venv/bin/python"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# Native builds and calibrations go to a throwaway cache, never the user's.
export OSCAR_EXPORT_CACHE="$TMP/cache"
HEADERS="$ROOT/build/ort-headers/usr/include/onnxruntime"
if [ -z "${ORT_INCLUDE_DIR:-}" ] && [ -f "$HEADERS/onnxruntime_c_api.h" ]; then
  export ORT_INCLUDE_DIR="$HEADERS"  # the checkout's fetched headers: no second apt fetch
fi

step() {  # step WHAT COMMAND...: the command's output shows only when it fails
  local what="$1" start=$SECONDS rc=0
  shift
  "$@" >"$TMP/step.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$TMP/step.log" >&2
    echo "wheel_test: $what: FAILED (exit $rc)" >&2
    exit 1
  fi
  echo "wheel_test: $what: ok ($((SECONDS - start)) s)"
}

mkdir -p "$TMP/dist" "$TMP/work"
step "sdist" "$PY" -c 'import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])' "$TMP/dist"
step "wheel from the sdist" "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$TMP/dist" \
  "$TMP"/dist/oscar_export-*.tar.gz
step "venv" "$PY" -m venv --without-pip "$TMP/venv"
VPY="$TMP/venv/bin/python"
step "install the wheel" "$PY" -m pip --python "$VPY" install -q --no-deps --no-index "$TMP"/dist/oscar_export-*.whl
# .venv's site-packages as a plain path entry: its .pth files (the editable hook that maps oscar_export
# to the checkout) are not processed there. Written after the install, so pip never sees .venv's
# oscar-export in this venv.
"$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
  > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/oscar_export_deps.pth"

cd "$TMP/work"
step "import from the venv, not the checkout" "$VPY" -c '
import sys, oscar_export, oscar_export.native as native
assert oscar_export.__file__.startswith(sys.argv[1]), oscar_export.__file__
assert not native.CHECKOUT and native.SOURCES.is_relative_to(sys.argv[1]), native.SOURCES' "$TMP/venv/"
step "native op library from the shipped sources" "$VPY" -c '
import os
from oscar_export.native import ort_library_path
path = ort_library_path()
assert path.is_relative_to(os.environ["OSCAR_EXPORT_CACHE"]), path'
step "oscar-export info" "$TMP/venv/bin/oscar-export" info
step "oscar-export plan" "$TMP/venv/bin/oscar-export" plan
step "export --target laptop" "$TMP/venv/bin/oscar-export" --target laptop --out "$TMP/art" --rotations hadamard
step "run" "$TMP/venv/bin/oscar-export" run --artifact "$TMP/art" --prompt "KING." --max-new-tokens 8
echo "wheel_test: all steps passed ($SECONDS s)"
