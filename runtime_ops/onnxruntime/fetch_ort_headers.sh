#!/usr/bin/env bash
# Fetch the ONNX Runtime C/C++ headers (the pip wheel ships none) from Debian trixie's
# libonnxruntime-dev package, without changing the system: a private apt sources list,
# lists and cache under build/ort-headers/apt, then `dpkg -x` into build/ort-headers/.
# The Debian mirror is the one this machine's apt already uses (no host is written here).
# Prints the include directory. ORT_INCLUDE_DIR set: prints it and fetches nothing;
# ORT_HEADERS_DEST overrides the destination (default build/ort-headers).
set -euo pipefail

if [ -n "${ORT_INCLUDE_DIR:-}" ]; then
  if [ ! -f "$ORT_INCLUDE_DIR/onnxruntime_c_api.h" ]; then
    echo "ORT_INCLUDE_DIR=$ORT_INCLUDE_DIR has no onnxruntime_c_api.h" >&2
    exit 2
  fi
  echo "$ORT_INCLUDE_DIR"
  exit 0
fi

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="${ORT_HEADERS_DEST:-$ROOT/build/ort-headers}"
INCLUDE="$DEST/usr/include/onnxruntime"
if [ -f "$INCLUDE/onnxruntime_c_api.h" ]; then
  echo "$INCLUDE"
  exit 0
fi
for tool in apt-get dpkg; do
  command -v "$tool" >/dev/null || { echo "fetch_ort_headers.sh needs $tool (Debian/Ubuntu); or set ORT_INCLUDE_DIR" >&2; exit 2; }
done

# The first Debian mirror URI in the machine's apt configuration: one-line sources.list
# entries ("deb URI suite ...") or deb822 .sources stanzas ("URIs: ..."), skipping the
# security archive (it has no trixie main suite under the same path).
mirror=""
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  mirror="$(awk '
    /^[[:space:]]*#/ { next }
    $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }; print $i; next }
    $1 == "URIs:" { for (i = 2; i <= NF; i++) print $i }
  ' "$f" | grep -E '/debian/?$' | grep -v -- '-security' | head -n 1 || true)"
  [ -n "$mirror" ] && break
done
if [ -z "$mirror" ]; then
  echo "no Debian mirror found in /etc/apt/sources.list or /etc/apt/sources.list.d/: set ORT_INCLUDE_DIR to the ONNX Runtime headers" >&2
  exit 2
fi

APT="$DEST/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${mirror%/} trixie main" > "$APT/sources.list"
opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o Debug::NoLocking=1
      -o APT::Sandbox::User=root)  # the private directories belong to the caller, not _apt
apt-get "${opts[@]}" -q update >&2
(cd "$APT/debs" && apt-get "${opts[@]}" -q download libonnxruntime-dev >&2)
deb="$(ls "$APT"/debs/libonnxruntime-dev_*.deb | head -n 1)"
dpkg -x "$deb" "$DEST"
if [ ! -f "$INCLUDE/onnxruntime_c_api.h" ]; then
  echo "$deb has no onnxruntime/onnxruntime_c_api.h" >&2
  exit 2
fi
echo "$INCLUDE"
