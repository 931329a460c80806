"""The ctypes mirrors against include/flashkda.h, as bindings/tools/fkda_header.py
describes it: prototypes, struct fields and the compiler's layouts."""

import ctypes
import os
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
    "fkda_fwd_args": _abi.FkdaFwdArgs,
    "fkda_decode_args": _abi.FkdaDecodeArgs,
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


def test_init_values_follow_the_header_macros():
    desc = _abi.FkdaPlanDesc.initialized()
    assert desc.struct_size == ctypes.sizeof(_abi.FkdaPlanDesc)
    assert (desc.head_dim_k, desc.head_dim_v, desc.lower_bound) == (128, 128, -5.0)
    assert desc.state_dtype == _abi.Dtype.F32 and desc.backend == _abi.Backend.AUTO
    assert desc.null_slot_rule == _abi.NullSlotRule.NEGATIVE and desc.debug_checks == 0
    for struct, fields in ((_abi.FkdaFwdArgs, _abi.FWD_TENSOR_FIELDS + _abi.FWD_POOL_TENSOR_FIELDS),
                           (_abi.FkdaDecodeArgs, _abi.DECODE_TENSOR_FIELDS)):
        args = struct.initialized()
        assert args.struct_size == ctypes.sizeof(struct)
        assert abs(args.scale - 128 ** -0.5) < 1e-7
        assert all(getattr(args, name).data is None and getattr(args, name).rank == 0
                   for name in fields)
    info = _abi.FkdaDeviceInfo.initialized()
    assert info.struct_size == ctypes.sizeof(_abi.FkdaDeviceInfo) and info.device == -1
    build = _abi.FkdaBuildInfo.initialized()
    assert build.struct_size == ctypes.sizeof(_abi.FkdaBuildInfo) and build.cuda_version == 0


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


def test_status_strings_and_last_error():
    assert flashkda.status_string(flashkda.Status.SUCCESS)
    assert flashkda.status_string(flashkda.Status.INVALID_ARGUMENT) != flashkda.status_string(
        flashkda.Status.NO_DEVICE)
    with pytest.raises(flashkda.FlashKDAError) as caught:
        flashkda.Plan(0, backend="cpu")
    assert caught.value.message
    with flashkda.Plan(1, backend="cpu"):
        assert flashkda.last_error() == ""
