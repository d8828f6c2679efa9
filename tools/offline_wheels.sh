#!/usr/bin/env bash
# The wheels minivllm needs beyond torch, for a machine that reaches no package index (GPU clusters often don't).
#
#   tools/offline_wheels.sh PYVER DIR     e.g. tools/offline_wheels.sh 3.12 wheels/   (on a machine with pip access)
#   tools/offline_wheels.sh --list        the requirements it downloads (settings.ini's, less torch)
#
# Then, on the machine without internet, where torch (its CUDA build) is installed already:
#   pip install --no-index --find-links DIR -e .
# pip finds torch installed and satisfied, and takes everything else from DIR. The wheels are for x86-64 Linux and
# CPython PYVER; what DIR holds is every requirement and every requirement of theirs, torch left out.
set -euo pipefail
cd "$(dirname "$0")/.."

requirements() {  # settings.ini's requirements, without torch (installed for its CUDA build, not fetched)
  python3 - <<'PY'
import configparser
c = configparser.ConfigParser()
c.read("settings.ini")
print("\n".join(r for r in c["DEFAULT"]["requirements"].split() if r.split(">")[0].split("=")[0] != "torch"))
PY
}

if [ "${1:-}" = "--list" ]; then requirements; exit 0; fi
pyver=${1:?usage: tools/offline_wheels.sh PYVER DIR (e.g. 3.12 wheels/), or --list}
dir=${2:?usage: tools/offline_wheels.sh PYVER DIR (e.g. 3.12 wheels/), or --list}
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 linux_x86_64; do platforms+=(--platform "$p"); done
# shellcheck disable=SC2046
python3 -m pip download --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
  -d "$dir" $(requirements)
if ls "$dir" | grep -qi '^torch-'; then
  echo "offline_wheels: a requirement pulled torch itself into $dir: remove it to keep the machine's CUDA build" >&2
fi
echo "offline_wheels: $(ls "$dir" | wc -l) wheels in $dir; on the offline machine: pip install --no-index --find-links $dir -e ." >&2
