# SPDX-License-Identifier: MIT
"""The wheel: it bundles libflashkda, installs offline into a fresh venv and
runs a forward pass there with nothing but the bundled library, whose
results follow the fp64 recurrence."""

import os
import re
import subprocess
import sys
import zipfile

import numpy

import flashkda
from kda_testing import kda_recurrence_fp64, rel_l2

PYTHON_BINDINGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PYTHON_BINDINGS)
import build_wheel  # noqa: E402

# Runs in the venv with the installed wheel only; saves its inputs and
# outputs so that the test, outside, can hold them against the fp64 recurrence.
SMOKE_TEST = r"""
import os, sys
import numpy as np
import flashkda

package_dir = os.path.dirname(os.path.abspath(flashkda.__file__))
assert package_dir.startswith(sys.prefix), (package_dir, sys.prefix)
assert flashkda.library_path() == os.path.join(package_dir, "libflashkda.so.0"), flashkda.library_path()

rng = np.random.default_rng(5)
B, T, H, K = 1, 40, 2, 128
q, k, v = (flashkda.to_bf16(rng.standard_normal((B, T, H, K))) for _ in range(3))
g = flashkda.to_bf16(rng.standard_normal((B, T, H, K)) - 6.0)  # slow decays: the state matters
beta = flashkda.to_bf16(rng.standard_normal((B, T, H)))
A_log = rng.uniform(0, 1, H).astype(np.float32)
dt_bias = rng.uniform(0, 1, (H, K)).astype(np.float32)
initial_state = rng.standard_normal((B, H, K, K)).astype(np.float32)
out = np.full((B, T, H, K), 0x7FC0, dtype=np.uint16)
final_state = np.full((B, H, K, K), np.nan, dtype=np.float32)
flashkda.fwd(q, k, v, g, beta, K ** -0.5, out, A_log, dt_bias, -5.0, initial_state=initial_state,
             final_state=final_state)
np.savez("smoke.npz", q=flashkda.from_bf16(q), k=flashkda.from_bf16(k), v=flashkda.from_bf16(v),
         g=flashkda.from_bf16(g), beta=flashkda.from_bf16(beta), A_log=A_log, dt_bias=dt_bias,
         initial_state=initial_state, out=flashkda.from_bf16(out), final_state=final_state)
print("flashkda", flashkda.version(), "from", flashkda.library_path())
"""

# BENCHMARKS.md's targets on slow-decay inputs with an f32 state.
OUT_TARGET = 3.0e-3
STATE_TARGET = 1.0e-3


def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    library = os.environ.get("FLASHKDA_LIBRARY") or flashkda.library_path()
    wheel = build_wheel.build_wheel(library, str(tmp_path / "dist"))

    name = os.path.basename(wheel)
    assert name.startswith("flashkda-" + flashkda.__version__ + "-py3-none-"), name
    assert name.endswith(build_wheel.PLATFORM + ".whl"), name
    # auditwheel's own reading of the library: the newest glibc it needs.
    shown = subprocess.run([build_wheel.find_auditwheel(), "show", wheel], check=True,
                           capture_output=True, text=True).stdout
    tag = re.search(r'consistent with the following platform tag:\s*"manylinux_2_(\d+)_x86_64"', shown)
    assert tag and int(tag.group(1)) <= 28, shown
    with zipfile.ZipFile(wheel) as archive:
        members = archive.namelist()
        assert "flashkda/libflashkda.so.0" in members
        assert "flashkda/__init__.py" in members
        with open(os.path.realpath(library), "rb") as built:
            assert archive.read("flashkda/libflashkda.so.0") == built.read()
        # The licence travels with the wheel: its SPDX expression in the
        # metadata and the file itself in the .dist-info.
        dist_info = "flashkda-" + flashkda.__version__ + ".dist-info/"
        metadata = archive.read(dist_info + "METADATA").decode()
        assert "\nLicense-Expression: MIT\n" in metadata, metadata
        assert "\nLicense-File: LICENSE\n" in metadata, metadata
        with open(os.path.join(PYTHON_BINDINGS, "..", "..", "LICENSE"), "rb") as licence:
            assert archive.read(dist_info + "licenses/LICENSE") == licence.read()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    venv_python = str(venv / "bin" / "python")
    # When this Python is itself a venv, --system-site-packages reaches the
    # base interpreter's packages, not this one's: point at numpy explicitly.
    # Entries of a .pth file come after the venv's own site-packages.
    site_packages = subprocess.run(
        [venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site_packages, "numpy_of_the_test_python.pth"), "w") as pth:
        pth.write(os.path.dirname(os.path.dirname(numpy.__file__)) + "\n")
    # Without FLASHKDA_LIBRARY or PYTHONPATH the venv can only use what it installed.
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("FLASHKDA_LIBRARY", "PYTHONPATH", "LD_LIBRARY_PATH")}
    environment["PIP_NO_INDEX"] = "1"
    subprocess.run([venv_python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--no-cache-dir", wheel], check=True, env=environment)
    result = subprocess.run([venv_python, "-c", SMOKE_TEST], cwd=str(tmp_path), env=environment,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert str(venv) in result.stdout

    run = numpy.load(tmp_path / "smoke.npz")
    expected_out, expected_state = kda_recurrence_fp64(
        run["q"], run["k"], run["v"], run["g"], run["beta"], run["A_log"], run["dt_bias"],
        128 ** -0.5, -5.0, initial_state=run["initial_state"])
    assert rel_l2(run["out"], expected_out) <= OUT_TARGET
    assert rel_l2(run["final_state"], expected_state) <= STATE_TARGET
