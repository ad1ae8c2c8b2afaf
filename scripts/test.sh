#!/usr/bin/env bash
# Command 2: run the whole test suite (installs .venv first if needed).
# Test files run in parallel worker processes (pytest-xdist), one file per worker at a time so a file's
# module fixtures (its exports) are made once: up to 4 workers, the cores shared out as torch threads.
# Pass -n 0 to run in this process (e.g. for a debugger); set OSCAR_TEST_WORKERS to choose the count.
set -euo pipefail
source "$(dirname "$0")/venv.sh"
# The CPUs this process may run on (nproc would count OMP_NUM_THREADS, which the CI sets for one of its passes).
cores="$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)))')"
workers="${OSCAR_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / workers > 0 ? cores / workers : 1 ))}"
# --no-loadscope-reorder: files go out in collection order, the long ones first (tests/conftest.py).
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
