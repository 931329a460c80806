"""The wheel: it bundles libflashkda, installs offline into a fresh venv and
runs a forward pass there with nothing but the bundled library."""

import os
import re
import subprocess
import sys
import zipfile

import numpy

import flashkda

PYTHON_BINDINGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PYTHON_BINDINGS)
import build_wheel  # noqa: E402

SMOKE_TEST = r"""
import os, sys
import numpy as np
import flashkda

package_dir = os.path.dirname(os.path.abspath(flashkda.__file__))
assert package_dir.startswith(sys.prefix), (package_dir, sys.prefix)
assert flashkda.library_path() == os.path.join(package_dir, "libflashkda.so.0"), flashkda.library_path()

rng = np.random.default_rng(5)
B, T, H, K = 1, 5, 1, 128
q, k, v, g = (flashkda.to_bf16(rng.standard_normal((B, T, H, K))) for _ in range(4))
beta = flashkda.to_bf16(rng.standard_normal((B, T, H)))
A_log = rng.uniform(0, 1, H).astype(np.float32)
dt_bias = rng.uniform(0, 1, (H, K)).astype(np.float32)
out = np.full((B, T, H, K), 0x7FC0, dtype=np.uint16)
final_state = np.full((B, H, K, K), np.nan, dtype=np.float32)
flashkda.fwd(q, k, v, g, beta, K ** -0.5, out, A_log, dt_bias, -5.0, final_state=final_state)
assert np.isfinite(flashkda.from_bf16(out)).all()
assert np.isfinite(final_state).all()
assert np.abs(final_state).max() > 0
print("flashkda", flashkda.version(), "from", flashkda.library_path())
"""


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
