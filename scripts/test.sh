#!/usr/bin/env bash
# Command 2: run the whole test suite (installs .venv first if needed).
set -euo pipefail
source "$(dirname "$0")/venv.sh"
exec .venv/bin/python -m pytest "$@"
