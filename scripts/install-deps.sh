#!/usr/bin/env bash
# Installs what the build and the tests need beyond the CUDA toolkit, from
# Debian's packages, and torch from PyPI for the torch-operator tests of the
# Python binding. Does nothing when everything is already there.
set -euo pipefail

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)

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
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "note: nvcc is at /usr/local/cuda/bin; CMake finds it there"
fi

# torch, for the CPU half of the torch-operator tests (opcheck, torch.compile),
# in the interpreter the binding tests use (bindings/CMakeLists.txt). PyPI's
# Linux wheel is a CUDA build whose declared dependencies add about 3 GB of
# CUDA wheels. The CUDA 13 toolkit this build needs already carries most of
# those libraries and the tests never touch a GPU through torch, so the wheel
# goes in without its dependencies, plus the libraries the toolkit lacks or
# has too old for it (NCCL, cuSPARSELt, NVSHMEM, cuFile) and its pure-Python
# dependencies: about 1.1 GB to fetch instead of about 4. Pinned, because the
# CUDA wheels must match the torch build.
torch_packages=(torch==2.15.0 nvidia-nccl-cu13==2.30.7 nvidia-cusparselt-cu13==0.8.1
                nvidia-nvshmem-cu13==3.7.2 nvidia-cufile==1.20.0.107 filelock==4.3.1
                typing-extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1
                jinja2==3.1.6 markupsafe==3.0.4 fsspec==2026.9.0)
if ! /usr/bin/python3 -c "import torch" >/dev/null 2>&1; then
  echo "installing torch for /usr/bin/python3 (CPU use, about 1.1 GB)"
  "${sudo_cmd[@]}" /usr/bin/python3 -m pip install --quiet --no-deps --break-system-packages \
    --root-user-action=ignore "${torch_packages[@]}"
  # A torch that installs but cannot load would skip the torch tests silently.
  /usr/bin/python3 -c "import torch; torch.ones(1)"
fi
