#!/usr/bin/env bash
# Installs what the build and the tests need beyond the CUDA toolkit, from
# Debian's packages. Does nothing when everything is already there.
set -euo pipefail

# clang and libclang-rt-dev (libFuzzer and the sanitizer runtimes) build tests/fuzz.
packages=(cmake g++ make catch2 nlohmann-json3-dev python3 python3-numpy python3-pytest
          python3-venv python3-pip python3-setuptools python3-wheel binutils pkgconf
          clang libclang-rt-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "note: nvcc is at /usr/local/cuda/bin; CMake finds it there"
fi
