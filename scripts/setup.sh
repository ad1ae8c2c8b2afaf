#!/usr/bin/env bash
# Command 1: create .venv, install oscar-export, run the main job on the bundled model.
set -euo pipefail
source "$(dirname "$0")/venv.sh"
.venv/bin/oscar-export report "$@"
