#!/usr/bin/env bash
# Command 1: create .venv, install oscar-export, run the main job on the bundled model: its memory
# plan and codec report, then the headline export, an ExecuTorch program with the 2-bit cache.
set -euo pipefail
source "$(dirname "$0")/venv.sh"
.venv/bin/oscar-export report "$@"
.venv/bin/oscar-export --target android --out oscar-android
