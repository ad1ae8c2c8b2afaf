# Sourced by setup.sh and test.sh: make .venv at the repo root and install the project into it.
# Idempotent: a stamp of pyproject.toml skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "oscar-export needs Python 3.11 or newer as '$PY' (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    # Debian/Ubuntu ship venv separately.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get install -y -q "python3-venv" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q python3-venv >/dev/null; }
      "$PY" -m venv .venv
    else
      echo "cannot create .venv: install your distribution's python3-venv package" >&2
      exit 2
    fi
  fi
fi

STAMP=.venv/.oscar-installed
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  # The CPU build of torch first, so no dependency pulls a multi-GB CUDA build on a CPU machine.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$WANT" > "$STAMP"
fi

# Native kernels (C++ core, ONNX Runtime op library): CMake, idempotent and fast when up to date.
.venv/bin/python -c "from oscar_export.native import build_native; build_native()" \
  || echo "warning: native kernels not built (see the message above); the ONNX Runtime target needs them" >&2
