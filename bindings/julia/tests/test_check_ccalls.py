# SPDX-License-Identifier: MIT
"""check_ccalls.py on the real package (must pass) and on broken copies of it
(each must fail, naming what is wrong)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

JULIA_BINDINGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKER = os.path.join(JULIA_BINDINGS, "check_ccalls.py")
PACKAGE = os.path.join(JULIA_BINDINGS, "FlashKDA")
HEADER = os.path.join(os.environ.get("FLASHKDA_INCLUDE_DIR",
                                     os.path.join(JULIA_BINDINGS, "..", "..", "include")),
                      "flashkda.h")
SOURCE = os.path.join("src", "FlashKDA.jl")


def run_checker(package):
    result = subprocess.run([sys.executable, CHECKER, "--header", HEADER, "--package", package],
                            capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


def ccall_count(output):
    """The number of ccalls the checker's summary line reports."""
    return int(re.search(r"(\d+) ccalls", output).group(1))


def broken_copy(tmp_path, old, new, relative=SOURCE):
    copy = tmp_path / "FlashKDA"
    shutil.copytree(PACKAGE, copy)
    path = copy / relative
    text = path.read_text()
    assert text.count(old) == 1, f"the mutation must hit exactly once: {old!r}"
    path.write_text(text.replace(old, new))
    return str(copy)


def test_the_real_package_wraps_every_header_function():
    sys.path.insert(0, os.path.join(JULIA_BINDINGS, "..", "tools"))
    import fkda_header

    count = len(fkda_header.parse(HEADER).functions)
    status, output = run_checker(PACKAGE)
    assert status == 0, output
    assert f"{count} of {count} header functions wrapped" in output


@pytest.mark.parametrize(
    "old, new, expected",
    [
        pytest.param("(:fkda_plan_workspace_size))(plan::fkda_plan_t, total_tokens::Int64",
                     "(:fkda_plan_workspace_size))(plan::fkda_plan_t, total_tokens::Int32",
                     ["fkda_plan_workspace_size", "total_tokens", "Int32"], id="wrong_argument_type"),
        pytest.param("args::Ref{fkda_fwd_args}, workspace::Ptr{Cvoid}",
                     "args::Ref{fkda_fwd_args}, workspace::Ptr{UInt8}",
                     ["fkda_fwd", "workspace"], id="wrong_pointee_type"),
        pytest.param("desc::Ref{fkda_plan_desc}", "desc::Ref{fkda_device_info}",
                     ["fkda_plan_create", "desc"], id="wrong_struct_pointer"),
        pytest.param("@ccall $(c_function(:fkda_version))()::UInt32",
                     "@ccall $(c_function(:fkda_version))()::Int32",
                     ["fkda_version", "returns Int32"], id="wrong_return_type"),
        pytest.param("\n                                                    num_seqs::Int64,", "",
                     ["fkda_plan_workspace_size", "3 arguments in the ccall, 4 in the header"],
                     id="missing_argument"),
        pytest.param("(device::Int32, info::Ref{fkda_device_info})",
                     "(device::Int32, extra::Int32, info::Ref{fkda_device_info})",
                     ["fkda_query_device", "3 arguments in the ccall, 2 in the header"],
                     id="extra_argument"),
        pytest.param(
            "fkda_query_device(device, info) =\n"
            "    @ccall $(c_function(:fkda_query_device))(device::Int32, "
            "info::Ref{fkda_device_info})::fkda_status\n",
            "", ["fkda_query_device", "no ccall wrapper"], id="missing_function"),
        pytest.param("$(c_function(:fkda_plan_destroy))", "$(c_function(:fkda_plan_destroyed))",
                     ["fkda_plan_destroyed", "not a function of the header",
                      "fkda_plan_destroy: exported by the header"], id="misspelt_function"),
        pytest.param("    rank::Int32\n", "    rank::Int64\n", ["struct fkda_tensor", "rank"],
                     id="wrong_struct_field"),
        pytest.param("    cc_minor::Int32\n", "", ["struct fkda_device_info", "cc_minor"],
                     id="missing_struct_field"),
        pytest.param("const fkda_plan_t = Ptr{fkda_plan_s}", "const fkda_plan_t = Ptr{Cvoid}",
                     ["fkda_plan_destroy", "fkda_plan_t"], id="wrong_alias"),
        pytest.param("FKDA_ERROR_DRIVER = fkda_status(4)", "FKDA_ERROR_DRIVER = fkda_status(5)",
                     ["FKDA_ERROR_DRIVER", "the header has 4"], id="wrong_enum_value"),
        pytest.param("const FKDA_BACKEND_GPU = fkda_backend(2)\n", "",
                     ["FKDA_BACKEND_GPU", "not defined"], id="missing_enum_constant"),
        pytest.param("    gate_mode::Int32\n", "", ["struct fkda_plan_desc", "gate_mode"],
                     id="missing_gate_mode_field"),
        pytest.param("    debug_checks::Int32\n    gate_mode::Int32\n    beta_mode::Int32\n",
                     "    debug_checks::Int32\n    beta_mode::Int32\n    gate_mode::Int32\n",
                     ["struct fkda_plan_desc", "beta_mode"], id="swapped_mode_fields"),
        pytest.param("const FKDA_GATE_LOG_DECAY = fkda_gate_mode(2)\n", "",
                     ["FKDA_GATE_LOG_DECAY", "not defined"], id="missing_gate_constant"),
        pytest.param("FKDA_BETA_PROBABILITIES = fkda_beta_mode(1)",
                     "FKDA_BETA_PROBABILITIES = fkda_beta_mode(0)",
                     ["FKDA_BETA_PROBABILITIES", "the header has 1"], id="wrong_beta_constant"),
        pytest.param("            choose(\"beta_mode\", beta_mode,\n"
                     "                   (logits=FKDA_BETA_LOGITS, probabilities=FKDA_BETA_PROBABILITIES)),\n",
                     "", ["fkda_plan_desc(...) passes 16 arguments, the struct has 17 fields"],
                     id="constructor_call_without_the_appended_field"),
        pytest.param("    checkpoint_slots::fkda_tensor\n    layer::fkda_layer_step\nend",
                     "    checkpoint_slots::fkda_tensor\nend",
                     ["struct fkda_fwd_args", "layer"], id="fwd_args_without_the_layer_step"),
        pytest.param("    out_norm_eps::Cfloat\n", "    out_norm_eps::Cdouble\n",
                     ["struct fkda_layer_step", "out_norm_eps", "Cdouble"],
                     id="layer_step_field_of_the_wrong_type"),
        pytest.param("checkpoints, checkpoint_slots, layer)", "checkpoints, checkpoint_slots)",
                     ["fkda_fwd_args(...) passes 19 arguments, the struct has 20 fields"],
                     id="raw_call_without_the_layer_step"),
        pytest.param("const FKDA_MAX_RANK = 6", "const FKDA_MAX_RANK = 5",
                     ["FKDA_MAX_RANK", "the header has 6"], id="wrong_define"),
        pytest.param("const FKDA_VERSION_PATCH = 0\n", "",
                     ["FKDA_VERSION_PATCH", "not defined"], id="missing_define"),
    ],
)
def test_broken_copies_fail_naming_the_problem(tmp_path, old, new, expected):
    status, output = run_checker(broken_copy(tmp_path, old, new))
    assert status == 1, output
    for fragment in expected:
        assert fragment in output, f"{fragment!r} missing from:\n{output}"


def test_ccalls_in_docstrings_and_comments_are_ignored(tmp_path):
    extra = ('"""\n    @ccall $(c_function(:fkda_bogus))(x::Float64)::Cvoid\n"""\n'
             'documented() = nothing\n'
             '# @ccall $(c_function(:fkda_other_bogus))()::Cvoid\n'
             'message() = "see @ccall $(c_function(:fkda_third_bogus))() in $("the docs")"\n')
    copy = broken_copy(tmp_path, "end # module", extra + "end # module")
    status, output = run_checker(copy)
    assert status == 0, output


def ccall_count(output):
    return int(re.search(r"(\d+) ccalls", output).group(1))


def test_the_tuple_form_of_ccall_is_checked(tmp_path):
    real = ccall_count(run_checker(PACKAGE)[1])
    good = "version_again() = ccall((:fkda_version, \"libflashkda.so.0\"), UInt32, ())\n"
    copy = broken_copy(tmp_path, "end # module", good + "end # module")
    status, output = run_checker(copy)
    assert status == 0, output
    assert ccall_count(output) == real + 1

    bad = ("lower_bound_again(plan, value) = "
           "ccall((:fkda_set_lower_bound, \"libflashkda.so.0\"), fkda_status, "
           "(fkda_plan_t, Float64), plan, value)\n")
    shutil.rmtree(tmp_path / "FlashKDA")
    copy = broken_copy(tmp_path, "end # module", bad + "end # module")
    status, output = run_checker(copy)
    assert status == 1
    assert "fkda_set_lower_bound" in output and "Float64" in output


def test_a_ccall_in_the_extension_is_checked(tmp_path):
    bad = ("FlashKDA.fkda_version() = "
           "@ccall $(FlashKDA.c_function(:fkda_version))(x::Int32)::UInt32\n")
    copy = broken_copy(tmp_path, "end # module", bad + "end # module",
                       relative=os.path.join("ext", "FlashKDACUDAExt.jl"))
    status, output = run_checker(copy)
    assert status == 1
    assert "FlashKDACUDAExt.jl" in output and "fkda_version" in output
