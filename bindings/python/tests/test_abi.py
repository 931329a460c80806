# SPDX-License-Identifier: MIT
"""The ctypes mirrors against include/flashkda.h, as bindings/tools/fkda_header.py
describes it: prototypes, struct fields and the compiler's layouts."""

import ctypes
import os
import re
import sys

import pytest

import flashkda
from flashkda import _abi

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import fkda_header  # noqa: E402

_CTYPES_CANONICAL = {
    ctypes.c_int: "i32",
    ctypes.c_int32: "i32",
    ctypes.c_uint32: "u32",
    ctypes.c_int64: "i64",
    ctypes.c_size_t: "usize",
    ctypes.c_float: "f32",
    ctypes.c_char_p: "ptr(char)",
    ctypes.c_void_p: "ptr(void)",
    None: "void",
}

_STRUCTS = {
    "fkda_tensor": _abi.FkdaTensor,
    "fkda_plan_desc": _abi.FkdaPlanDesc,
    "fkda_layer_step": _abi.FkdaLayerStep,
    "fkda_fwd_args": _abi.FkdaFwdArgs,
    "fkda_decode_args": _abi.FkdaDecodeArgs,
    "fkda_transition_args": _abi.FkdaTransitionArgs,
    "fkda_apply_args": _abi.FkdaApplyArgs,
    "fkda_device_info": _abi.FkdaDeviceInfo,
    "fkda_launch_report": _abi.FkdaLaunchReport,
    "fkda_build_info": _abi.FkdaBuildInfo,
}


def canonical(ctype):
    if ctype in _CTYPES_CANONICAL:
        return _CTYPES_CANONICAL[ctype]
    for tag, struct in _STRUCTS.items():
        if ctype is struct:
            return f"struct {tag}"
    if hasattr(ctype, "_type_") and issubclass(ctype, ctypes._Pointer):
        return f"ptr({canonical(ctype._type_)})"
    if issubclass(ctype, ctypes.Array):
        element = "char" if ctype._type_ is ctypes.c_char else canonical(ctype._type_)
        return f"array({element},{ctype._length_})"
    raise AssertionError(f"no canonical form for {ctype}")


def loosen(canonical_type):
    """ctypes has no const, and opaque handles are void* in it."""
    canonical_type = fkda_header.without_const(canonical_type)
    for opaque in ("ptr(struct fkda_plan_s)", "ptr(struct CUstream_st)"):
        canonical_type = canonical_type.replace(opaque, "ptr(void)")
    return canonical_type


@pytest.fixture(scope="module")
def header(header_path):
    return fkda_header.describe(header_path)


def test_every_header_function_is_declared(header):
    assert sorted(header["functions"]) == sorted(_abi.PROTOTYPES)


def test_prototypes_match_the_header(header):
    for name, function in header["functions"].items():
        restype, argtypes = _abi.PROTOTYPES[name]
        assert canonical(restype) == loosen(function["return"]["canonical"]), name
        assert len(argtypes) == len(function["params"]), name
        for argtype, param in zip(argtypes, function["params"]):
            assert canonical(argtype) == loosen(param["canonical"]), f"{name}({param['name']})"


def test_struct_fields_match_the_header(header):
    assert set(_STRUCTS) == set(header["structs"])
    for tag, struct in _STRUCTS.items():
        expected = [(f["name"], loosen(f["canonical"])) for f in header["structs"][tag]["fields"]]
        actual = [(name, canonical(ctype)) for name, ctype in struct._fields_]
        assert actual == expected, tag


def test_enums_match_the_header(header):
    mirrors = {
        "fkda_status": (_abi.Status, "FKDA_"),
        "fkda_dtype": (_abi.Dtype, "FKDA_DTYPE_"),
        "fkda_backend": (_abi.Backend, "FKDA_BACKEND_"),
        "fkda_state_layout": (_abi.StateLayout, "FKDA_STATE_LAYOUT_"),
        "fkda_null_slot_rule": (_abi.NullSlotRule, "FKDA_NULL_SLOT_"),
        "fkda_gate_mode": (_abi.GateMode, "FKDA_GATE_"),
        "fkda_beta_mode": (_abi.BetaMode, "FKDA_BETA_"),
        "fkda_chunk_parallel": (_abi.ChunkParallel, "FKDA_CHUNK_PARALLEL_"),
    }
    assert set(mirrors) == set(header["enums"])
    for enum_name, (mirror, prefix) in mirrors.items():
        expected = {
            name[len(prefix):].replace("ERROR_", ""): value
            for name, value in header["enums"][enum_name]["constants"].items()
        }
        assert {member.name: member.value for member in mirror} == expected, enum_name
    assert header["defines"]["FKDA_MAX_RANK"] == _abi.MAX_RANK


def test_layouts_match_the_c_compiler(header):
    for tag, struct in _STRUCTS.items():
        layout = header["structs"][tag]
        assert ctypes.sizeof(struct) == layout["size"], tag
        for (name, _), field in zip(struct._fields_, layout["fields"]):
            assert getattr(struct, name).offset == field["offset"], f"{tag}.{name}"


def described(value):
    """A ctypes value the way the header description prints _INIT values:
    pointers as addresses, char arrays as text, structs as dicts."""
    if isinstance(value, ctypes.Structure):
        return {name: described(getattr(value, name)) for name, _ in value._fields_}
    if isinstance(value, ctypes.Array):
        return [described(item) for item in value]
    if isinstance(value, bytes):  # a char array reads as bytes
        return value.decode()
    return 0 if value is None else value  # a NULL pointer reads as None


def test_init_values_follow_the_header_macros(header):
    for tag, struct in _STRUCTS.items():
        init = header["structs"][tag]["init"]
        # FKDA_TENSOR_NONE is all zeros, a default-constructed FkdaTensor.
        value = struct.initialized() if hasattr(struct, "initialized") else struct()
        assert described(value) == init["values"], init["macro"]


def test_build_info_names_the_kernels():
    info = flashkda.build_info()
    assert info.cuda_version >= info.min_driver_version >= 12000
    assert info.min_driver_version % 1000 == 0
    assert "sm_80" in info.architectures.split() and "sm_90a" in info.architectures.split()


def test_version_matches_the_header(header):
    defines = header["defines"]
    number = (defines["FKDA_VERSION_MAJOR"] * 10000 + defines["FKDA_VERSION_MINOR"] * 100
              + defines["FKDA_VERSION_PATCH"])
    assert flashkda.version_number() == number
    assert flashkda.version() == "{}.{}.{}".format(
        defines["FKDA_VERSION_MAJOR"], defines["FKDA_VERSION_MINOR"], defines["FKDA_VERSION_PATCH"])
    assert flashkda.__version__ == flashkda.version()


def test_every_package_carries_the_header_version(header):
    """The Python, Rust and Julia packages ship the library of this header:
    a package version that lags behind it names an ABI it does not bind."""
    defines = header["defines"]
    version = "{}.{}.{}".format(defines["FKDA_VERSION_MAJOR"], defines["FKDA_VERSION_MINOR"],
                                defines["FKDA_VERSION_PATCH"])
    bindings = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    manifests = {
        "python/pyproject.toml": r'^version = "([^"]+)"',
        "rust/Cargo.toml": r'^version = "([^"]+)"',
        "rust/flashkda/Cargo.toml": r'^flashkda-sys = \{[^}]*version = "([^"]+)"',
        "julia/FlashKDA/Project.toml": r'^version = "([^"]+)"',
    }
    for manifest, pattern in manifests.items():
        with open(os.path.join(bindings, manifest)) as f:
            found = re.search(pattern, f.read(), re.MULTILINE)
        assert found is not None, manifest
        assert found.group(1) == version, manifest
    with open(os.path.join(bindings, "rust", "Cargo.lock")) as f:
        locked = re.findall(r'name = "(flashkda[-a-z]*)"\nversion = "([^"]+)"', f.read())
    assert {name for name, _ in locked} == {"flashkda", "flashkda-sys"}
    assert all(locked_version == version for _, locked_version in locked)


def test_status_strings_and_last_error():
    assert flashkda.status_string(flashkda.Status.SUCCESS)
    assert flashkda.status_string(flashkda.Status.INVALID_ARGUMENT) != flashkda.status_string(
        flashkda.Status.NO_DEVICE)
    with pytest.raises(flashkda.FlashKDAError) as caught:
        flashkda.Plan(0, backend="cpu")
    assert caught.value.message
    with flashkda.Plan(1, backend="cpu"):
        assert flashkda.last_error() == ""
