# SPDX-License-Identifier: MIT
"""
    FlashKDA

Julia bindings of libflashkda: Kimi Delta Attention (KDA) forward passes
behind the C ABI of `include/flashkda.h`, wrapped one to one with `@ccall`.

Julia arrays are column-major, the library's tensors row-major: an array
passes with its dimensions in reverse order. `q` of the C shape `[B, T, H, K]`
is a Julia array of size `(K, H, T, B)`; a state `[N, H, V, K]` is `(K, V, H, N)`.

Host `Array`s (and strided views of them) run on the CPU backend. `CuArray`s
run on the GPU backend once CUDA.jl is loaded (the `FlashKDACUDAExt`
extension). bf16 data is `UInt16` bit patterns or `Core.BFloat16` where the
Julia version has it; `to_bf16` and `from_bf16` convert.

The library is found through `load_library(path)`, else the
`FLASHKDA_LIBRARY` environment variable (a path to `libflashkda.so.0`), else
a copy bundled in the package's `lib/` directory, else the system loader.
"""
module FlashKDA

using Libdl

export FlashKDAError, Plan, fwd!, fwd_raw!, decode!, transitions!, apply_transitions!, tensor, raw_layer_step,
       workspace_size,
       decode_workspace_size, transitions_workspace_size,
       backend, lower_bound, set_lower_bound!, query_device, build_info, version, version_string, to_bf16,
       from_bf16, load_library, library_path

# ------------------------------------------------------------------------
# Mirrors of include/flashkda.h
# ------------------------------------------------------------------------

const FKDA_VERSION_MAJOR = 0
const FKDA_VERSION_MINOR = 5
const FKDA_VERSION_PATCH = 0
const FKDA_VERSION_NUMBER = FKDA_VERSION_MAJOR * 10000 + FKDA_VERSION_MINOR * 100 + FKDA_VERSION_PATCH

# C enums are int.
const fkda_status = Cint
const FKDA_SUCCESS = fkda_status(0)
const FKDA_ERROR_INVALID_ARGUMENT = fkda_status(1)
const FKDA_ERROR_UNSUPPORTED = fkda_status(2)
const FKDA_ERROR_NO_DEVICE = fkda_status(3)
const FKDA_ERROR_DRIVER = fkda_status(4)
const FKDA_ERROR_UNSUPPORTED_ARCH = fkda_status(5)
const FKDA_ERROR_WORKSPACE_TOO_SMALL = fkda_status(6)
const FKDA_ERROR_LAUNCH_FAILED = fkda_status(7)
const FKDA_ERROR_OUT_OF_MEMORY = fkda_status(8)
const FKDA_ERROR_INTERNAL = fkda_status(9)

const fkda_dtype = Cint
const FKDA_DTYPE_INVALID = fkda_dtype(0)
const FKDA_DTYPE_BF16 = fkda_dtype(1)
const FKDA_DTYPE_F16 = fkda_dtype(2)
const FKDA_DTYPE_F32 = fkda_dtype(3)
const FKDA_DTYPE_I32 = fkda_dtype(4)
const FKDA_DTYPE_I64 = fkda_dtype(5)
const FKDA_DTYPE_BOOL = fkda_dtype(6)

const FKDA_MAX_RANK = 6

struct fkda_tensor
    data::Ptr{Cvoid}
    dtype::Int32
    rank::Int32
    shape::NTuple{6,Int64}
    strides::NTuple{6,Int64}
end

const FKDA_TENSOR_NONE = fkda_tensor(C_NULL, FKDA_DTYPE_INVALID, 0, ntuple(_ -> 0, 6), ntuple(_ -> 0, 6))

const fkda_backend = Cint
const FKDA_BACKEND_AUTO = fkda_backend(0)
const FKDA_BACKEND_CPU = fkda_backend(1)
const FKDA_BACKEND_GPU = fkda_backend(2)

const fkda_state_layout = Cint
const FKDA_STATE_LAYOUT_VK = fkda_state_layout(0)
const FKDA_STATE_LAYOUT_KV = fkda_state_layout(1)

const fkda_null_slot_rule = Cint
const FKDA_NULL_SLOT_NEGATIVE = fkda_null_slot_rule(0)
const FKDA_NULL_SLOT_NONPOSITIVE = fkda_null_slot_rule(1)

const fkda_gate_mode = Cint
const FKDA_GATE_BOUNDED = fkda_gate_mode(0)
const FKDA_GATE_SOFTPLUS = fkda_gate_mode(1)
const FKDA_GATE_LOG_DECAY = fkda_gate_mode(2)

const fkda_beta_mode = Cint
const FKDA_BETA_LOGITS = fkda_beta_mode(0)
const FKDA_BETA_PROBABILITIES = fkda_beta_mode(1)

const fkda_chunk_parallel = Cint
const FKDA_CHUNK_PARALLEL_AUTO = fkda_chunk_parallel(0)
const FKDA_CHUNK_PARALLEL_OFF = fkda_chunk_parallel(1)
const FKDA_CHUNK_PARALLEL_ON = fkda_chunk_parallel(2)

# Opaque types behind the handle typedefs.
struct fkda_plan_s end
struct CUstream_st end
const fkda_plan_t = Ptr{fkda_plan_s}
const fkda_stream_t = Ptr{CUstream_st}

struct fkda_plan_desc
    struct_size::Csize_t
    num_heads::Int32
    head_dim_k::Int32
    head_dim_v::Int32
    state_dtype::Int32
    state_layout::Int32
    backend::Int32
    lower_bound::Cfloat
    null_slot_rule::Int32
    debug_checks::Int32
    gate_mode::Int32
    beta_mode::Int32
    vsplit::Int32
    chunk_parallel::Int32
    window_slots::Int64
    segment_chunks::Int64
    layer_step::Int32
end

# The layer step around the recurrence (appended in 0.5): a member of the
# fwd and decode args.
struct fkda_layer_step
    conv_weight_q::fkda_tensor
    conv_weight_k::fkda_tensor
    conv_weight_v::fkda_tensor
    conv_bias_q::fkda_tensor
    conv_bias_k::fkda_tensor
    conv_bias_v::fkda_tensor
    conv_state_q::fkda_tensor
    conv_state_k::fkda_tensor
    conv_state_v::fkda_tensor
    out_gate::fkda_tensor
    out_norm_weight::fkda_tensor
    out_norm_eps::Cfloat
    reserved::Int32
end

const DEFAULT_OUT_NORM_EPS = 1.0f-5
const FKDA_LAYER_STEP_INIT = fkda_layer_step(FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,
                                             FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,
                                             FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,
                                             FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, DEFAULT_OUT_NORM_EPS,
                                             Int32(0))

struct fkda_fwd_args
    struct_size::Csize_t
    q::fkda_tensor
    k::fkda_tensor
    v::fkda_tensor
    g::fkda_tensor
    beta::fkda_tensor
    A_log::fkda_tensor
    dt_bias::fkda_tensor
    out::fkda_tensor
    initial_state::fkda_tensor
    final_state::fkda_tensor
    cu_seqlens::fkda_tensor
    scale::Cfloat
    state_pool::fkda_tensor
    state_indices::fkda_tensor
    has_initial_state::fkda_tensor
    checkpoint_offsets::fkda_tensor
    checkpoints::fkda_tensor
    checkpoint_slots::fkda_tensor
    layer::fkda_layer_step
end

struct fkda_decode_args
    struct_size::Csize_t
    q::fkda_tensor
    k::fkda_tensor
    v::fkda_tensor
    g::fkda_tensor
    beta::fkda_tensor
    A_log::fkda_tensor
    dt_bias::fkda_tensor
    out::fkda_tensor
    state_pool::fkda_tensor
    state_indices::fkda_tensor
    num_accepted_tokens::fkda_tensor
    cu_seqlens::fkda_tensor
    scale::Cfloat
    layer::fkda_layer_step
end

struct fkda_transition_args
    struct_size::Csize_t
    k::fkda_tensor
    v::fkda_tensor
    g::fkda_tensor
    beta::fkda_tensor
    A_log::fkda_tensor
    dt_bias::fkda_tensor
    cu_seqlens::fkda_tensor
    transition_m::fkda_tensor
    transition_e::fkda_tensor
end

struct fkda_apply_args
    struct_size::Csize_t
    transition_m::fkda_tensor
    transition_e::fkda_tensor
    initial_state::fkda_tensor
    final_state::fkda_tensor
end

struct fkda_device_info
    struct_size::Csize_t
    driver_loaded::Int32
    driver_version::Int32
    device_count::Int32
    device::Int32
    cc_major::Int32
    cc_minor::Int32
    has_kernels::Int32
    name::NTuple{256,Cchar}
end

struct fkda_launch_report
    struct_size::Csize_t
    vsplit::Int64
    windows::Int64
    slots_per_window::Int64
    chunk_parallel::Int64
    segment_chunks::Int64
end

struct fkda_build_info
    struct_size::Csize_t
    cuda_version::Int32
    min_driver_version::Int32
    architectures::NTuple{64,Cchar}
end

# ------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------

"""
    FlashKDAError(status, message)

A failing call. `status` is the library's `fkda_status` (an `Int32`), or
`nothing` when the library could not be loaded; `message` is
`fkda_last_error()`, naming the argument, or this binding's own message for
mistakes it catches first (with `FKDA_ERROR_INVALID_ARGUMENT`).
"""
struct FlashKDAError <: Exception
    status::Union{Nothing,Int32}
    message::String
end

function Base.showerror(io::IO, e::FlashKDAError)
    print(io, "FlashKDAError: ", e.message)
    if e.status !== nothing
        text = LIBRARY[] === nothing ? "" : status_string(e.status)
        print(io, " [status ", e.status, isempty(text) ? "" : ": " * text, "]")
    end
end

invalid_argument(message) = FlashKDAError(FKDA_ERROR_INVALID_ARGUMENT, message)

# ------------------------------------------------------------------------
# The library
# ------------------------------------------------------------------------

const LIBRARY_ENV = "FLASHKDA_LIBRARY"
const SONAME = "libflashkda.so.0"
const BUNDLED_PATH = normpath(joinpath(@__DIR__, "..", "lib", SONAME))

const FUNCTION_NAMES = (
    :fkda_status_string, :fkda_last_error, :fkda_version, :fkda_version_string,
    :fkda_plan_create, :fkda_plan_destroy, :fkda_plan_get_backend, :fkda_set_lower_bound,
    :fkda_get_lower_bound, :fkda_plan_workspace_size, :fkda_fwd, :fkda_plan_decode_workspace_size,
    :fkda_decode, :fkda_plan_transitions_workspace_size, :fkda_transitions,
    :fkda_apply_transitions, :fkda_query_device, :fkda_plan_get_launch_report, :fkda_get_build_info,
)

struct LoadedLibrary
    handle::Ptr{Cvoid}
    path::String
    functions::Dict{Symbol,Ptr{Cvoid}}
end

const LIBRARY = Ref{Union{Nothing,LoadedLibrary}}(nothing)
const LIBRARY_LOCK = ReentrantLock()

function open_library(path::AbstractString, origin::AbstractString, must_exist::Bool)
    if must_exist && !isfile(path)
        throw(FlashKDAError(nothing, "library: $path ($origin) does not exist"))
    end
    handle = Libdl.dlopen(path, Libdl.RTLD_LAZY | Libdl.RTLD_LOCAL; throw_error=false)
    handle === nothing && throw(FlashKDAError(nothing, "library: cannot load $path ($origin)"))
    functions = Dict{Symbol,Ptr{Cvoid}}()
    for name in FUNCTION_NAMES
        pointer = Libdl.dlsym(handle, name; throw_error=false)
        pointer === nothing && throw(FlashKDAError(nothing, "library: $path ($origin) lacks $name"))
        functions[name] = pointer
    end
    # The file the loader actually opened, also when found by name.
    return LoadedLibrary(handle, Libdl.dlpath(handle), functions)
end

"""
    load_library(path=nothing)

Loads libflashkda: from `path`, else from `ENV["FLASHKDA_LIBRARY"]`, else the
copy in the package's `lib/`, else through the system loader. Plans hold raw
handles of the loaded library, so once one is loaded another path is refused.
"""
function load_library(path::Union{Nothing,AbstractString}=nothing)
    lock(LIBRARY_LOCK) do
        current = LIBRARY[]
        if current !== nothing
            path === nothing && return current
            isfile(path) || throw(FlashKDAError(nothing,
                "library: $path (path given to load_library) does not exist"))
            realpath(path) == realpath(current.path) && return current
            throw(FlashKDAError(nothing,
                "library: already loaded from $(current.path); cannot switch to $path"))
        end
        loaded = if path !== nothing
            open_library(path, "path given to load_library", true)
        elseif !isempty(get(ENV, LIBRARY_ENV, ""))
            open_library(ENV[LIBRARY_ENV], "from $LIBRARY_ENV", true)
        elseif isfile(BUNDLED_PATH)
            open_library(BUNDLED_PATH, "bundled with the package", true)
        else
            try
                open_library(SONAME, "system loader", false)
            catch error
                error isa FlashKDAError || rethrow()
                throw(FlashKDAError(nothing,
                    "library: libflashkda not found: set $LIBRARY_ENV to the path of $SONAME, " *
                    "call FlashKDA.load_library(path), or install it where the system loader " *
                    "finds it ($(error.message))"))
            end
        end
        LIBRARY[] = loaded
        return loaded
    end
end

"""The path of the library in use (loading it if needed)."""
library_path() = library().path

library() = (loaded = LIBRARY[]; loaded === nothing ? load_library() : loaded)

c_function(name::Symbol) = library().functions[name]

# ------------------------------------------------------------------------
# One wrapper per C function, same name, same arguments
# ------------------------------------------------------------------------

fkda_status_string(status) =
    @ccall $(c_function(:fkda_status_string))(status::fkda_status)::Ptr{Cchar}

fkda_last_error() = @ccall $(c_function(:fkda_last_error))()::Ptr{Cchar}

fkda_version() = @ccall $(c_function(:fkda_version))()::UInt32

fkda_version_string() = @ccall $(c_function(:fkda_version_string))()::Ptr{Cchar}

fkda_plan_create(desc, plan) =
    @ccall $(c_function(:fkda_plan_create))(desc::Ref{fkda_plan_desc}, plan::Ref{fkda_plan_t})::fkda_status

fkda_plan_destroy(plan) = @ccall $(c_function(:fkda_plan_destroy))(plan::fkda_plan_t)::fkda_status

fkda_plan_get_backend(plan, backend) =
    @ccall $(c_function(:fkda_plan_get_backend))(plan::fkda_plan_t, backend::Ref{fkda_backend})::fkda_status

fkda_set_lower_bound(plan, lower_bound) =
    @ccall $(c_function(:fkda_set_lower_bound))(plan::fkda_plan_t, lower_bound::Cfloat)::fkda_status

fkda_get_lower_bound(plan, lower_bound) =
    @ccall $(c_function(:fkda_get_lower_bound))(plan::fkda_plan_t, lower_bound::Ref{Cfloat})::fkda_status

fkda_plan_workspace_size(plan, total_tokens, num_seqs, bytes) =
    @ccall $(c_function(:fkda_plan_workspace_size))(plan::fkda_plan_t, total_tokens::Int64,
                                                    num_seqs::Int64, bytes::Ref{Csize_t})::fkda_status

fkda_fwd(plan, args, workspace, workspace_bytes, stream) =
    @ccall $(c_function(:fkda_fwd))(plan::fkda_plan_t, args::Ref{fkda_fwd_args}, workspace::Ptr{Cvoid},
                                    workspace_bytes::Csize_t, stream::fkda_stream_t)::fkda_status

fkda_plan_decode_workspace_size(plan, total_tokens, num_seqs, bytes) =
    @ccall $(c_function(:fkda_plan_decode_workspace_size))(plan::fkda_plan_t, total_tokens::Int64,
                                                           num_seqs::Int64, bytes::Ref{Csize_t})::fkda_status

fkda_decode(plan, args, workspace, workspace_bytes, stream) =
    @ccall $(c_function(:fkda_decode))(plan::fkda_plan_t, args::Ref{fkda_decode_args}, workspace::Ptr{Cvoid},
                                       workspace_bytes::Csize_t, stream::fkda_stream_t)::fkda_status

fkda_plan_transitions_workspace_size(plan, total_tokens, num_seqs, bytes) =
    @ccall $(c_function(:fkda_plan_transitions_workspace_size))(plan::fkda_plan_t, total_tokens::Int64,
                                                                num_seqs::Int64, bytes::Ref{Csize_t})::fkda_status
fkda_transitions(plan, args, workspace, workspace_bytes, stream) =
    @ccall $(c_function(:fkda_transitions))(plan::fkda_plan_t, args::Ref{fkda_transition_args},
                                            workspace::Ptr{Cvoid}, workspace_bytes::Csize_t,
                                            stream::fkda_stream_t)::fkda_status
fkda_apply_transitions(plan, args, workspace, workspace_bytes, stream) =
    @ccall $(c_function(:fkda_apply_transitions))(plan::fkda_plan_t, args::Ref{fkda_apply_args},
                                                  workspace::Ptr{Cvoid}, workspace_bytes::Csize_t,
                                                  stream::fkda_stream_t)::fkda_status
fkda_query_device(device, info) =
    @ccall $(c_function(:fkda_query_device))(device::Int32, info::Ref{fkda_device_info})::fkda_status

fkda_plan_get_launch_report(plan, report) =
    @ccall $(c_function(:fkda_plan_get_launch_report))(plan::fkda_plan_t,
                                                       report::Ref{fkda_launch_report})::fkda_status

fkda_get_build_info(info) =
    @ccall $(c_function(:fkda_get_build_info))(info::Ref{fkda_build_info})::fkda_status

# ------------------------------------------------------------------------
# Status handling
# ------------------------------------------------------------------------

c_text(pointer::Ptr{Cchar}) = pointer == C_NULL ? "" : unsafe_string(pointer)

"""`fkda_status_string`: the library's static text for a status."""
status_string(status::Integer) = c_text(fkda_status_string(fkda_status(status)))

"""`fkda_last_error`: the message of the last failing call on this thread."""
last_error() = c_text(fkda_last_error())

function check(status::Integer)
    status == FKDA_SUCCESS && return nothing
    throw(FlashKDAError(Int32(status), last_error()))
end

"""`fkda_version`: MAJOR * 10000 + MINOR * 100 + PATCH of the loaded library."""
version() = Int(fkda_version())

"""`fkda_version_string`: "MAJOR.MINOR.PATCH" of the loaded library."""
version_string() = c_text(fkda_version_string())

# ------------------------------------------------------------------------
# Arrays -> fkda_tensor
# ------------------------------------------------------------------------

dtype_of(::Type{UInt16}) = FKDA_DTYPE_BF16  # bf16 bit patterns
dtype_of(::Type{Float16}) = FKDA_DTYPE_F16
dtype_of(::Type{Float32}) = FKDA_DTYPE_F32
dtype_of(::Type{Int32}) = FKDA_DTYPE_I32
dtype_of(::Type{Int64}) = FKDA_DTYPE_I64
dtype_of(::Type{Bool}) = FKDA_DTYPE_BOOL
dtype_of(::Type) = nothing
@static if isdefined(Core, :BFloat16)
    dtype_of(::Type{Core.BFloat16}) = FKDA_DTYPE_BF16
end

"""
    memory_kind(array) -> :host, :device or nothing

Where an array lives (`nothing`: not an array this binding can pass). The
CUDA extension adds `:device` for CuArrays.
"""
memory_kind(::StridedArray) = :host
memory_kind(::Any) = nothing

"""The address of an array's first element as the library sees it."""
data_pointer(array::StridedArray) = Ptr{Cvoid}(pointer(array))

function to_int32(name, value)
    value isa Integer || throw(invalid_argument("$name: expected an integer, got $(typeof(value))"))
    typemin(Int32) <= value <= typemax(Int32) || throw(invalid_argument("$name: $value does not fit in int32"))
    return Int32(value)
end

function to_bool(name, value)
    value isa Bool || throw(invalid_argument("$name: expected true or false, got $(typeof(value))"))
    return value
end

function to_float32(name, value)
    value isa Real || throw(invalid_argument("$name: expected a number, got $(typeof(value))"))
    return Float32(value)
end

function padded(values, count)
    return ntuple(i -> i <= count ? Int64(values[i]) : Int64(0), FKDA_MAX_RANK)
end

"""
    tensor_of(name, array) -> fkda_tensor

Describes `array` in C order (dimensions and strides reversed). Dtype, shape
and stride rules are checked by the library, which names `name`.
"""
tensor_of(name, ::Nothing) = FKDA_TENSOR_NONE
function tensor_of(name, array)
    memory_kind(array) === nothing && throw(invalid_argument(
        "$name: $(typeof(array)) is neither a strided host array nor a CuArray " *
        "(CuArrays need CUDA.jl loaded)"))
    dtype = dtype_of(eltype(array))
    dtype === nothing && throw(invalid_argument(
        "$name: element type $(eltype(array)) has no flashkda dtype " *
        "(UInt16 or BFloat16 for bf16, Float16, Float32, Int32, Int64, Bool)"))
    rank = ndims(array)
    rank <= FKDA_MAX_RANK || throw(invalid_argument("$name: rank $rank exceeds the maximum of $FKDA_MAX_RANK"))
    c_shape = reverse(size(array))
    c_strides = reverse(strides(array))
    return fkda_tensor(data_pointer(array), dtype, rank, padded(c_shape, rank), padded(c_strides, rank))
end

"""
    tensor(pointer::Ptr{T}, dims; strides=nothing) -> fkda_tensor

A descriptor over raw memory for `fwd_raw!`, in Julia's column-major order:
`dims` and `strides` (in elements, default column-major contiguous) are
reversed into the library's row-major order. With CUDA.jl loaded, `pointer`
may be a `CuPtr{T}`.
"""
tensor(pointer::Ptr{T}, dims::Dims; strides=nothing) where {T} =
    tensor_from_pointer(Ptr{Cvoid}(pointer), T, dims, strides)

function tensor_from_pointer(data::Ptr{Cvoid}, ::Type{T}, dims::Dims, strides) where {T}
    dtype = dtype_of(T)
    dtype === nothing && throw(invalid_argument("tensor: element type $T has no flashkda dtype"))
    rank = length(dims)
    rank <= FKDA_MAX_RANK || throw(invalid_argument("tensor: rank $rank exceeds the maximum of $FKDA_MAX_RANK"))
    if strides === nothing
        strides = Base.size_to_strides(1, dims...)
    end
    length(strides) == rank || throw(invalid_argument("tensor: $(length(strides)) strides for rank $rank"))
    return fkda_tensor(data, dtype, rank, padded(reverse(dims), rank), padded(reverse(Tuple(strides)), rank))
end

"""A raw address for the library; the CUDA extension adds `CuPtr`."""
raw_pointer(pointer::Ptr) = Ptr{Cvoid}(pointer)

# Hooks the CUDA extension specialises for :device.
allocate_workspace(::Val{:host}, bytes, like) = Vector{UInt8}(undef, bytes)
allocate_workspace(::Val{kind}, bytes, like) where {kind} =
    throw(invalid_argument("workspace: cannot allocate $kind memory; pass a buffer of $bytes bytes"))
default_stream(::Val{:host}, like) = fkda_stream_t(C_NULL)
on_device_of(f, ::Val{:host}, like) = f()
stream_handle(stream::Ptr) = fkda_stream_t(stream)
stream_handle(stream::Integer) = fkda_stream_t(UInt(stream))

# ------------------------------------------------------------------------
# Plans
# ------------------------------------------------------------------------

"""
    Plan(num_heads; head_dim_k=128, head_dim_v=128, state_dtype=Float32,
         state_layout=:VK, backend=:auto, lower_bound=-5,
         null_slot_rule=:negative, debug_checks=false,
         gate_mode=:bounded, beta_mode=:logits)

An `fkda_plan_t`. `state_dtype` is `Float32` or bf16 (`UInt16`, `:bf16`);
`backend` is `:auto`, `:cpu` or `:gpu`. `null_slot_rule` says which pool
indices mean padding: `:negative` (index < 0) or `:nonpositive` (index <= 0,
slot 0 reserved). `debug_checks` makes GPU calls check device-side indices on
the host first (synchronising). Destroyed by `close(plan)` or, as a fallback,
by a finalizer. Not to be used from several tasks at once.

`gate_mode` says how `g` becomes each token's decay: `:bounded`
(`lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`, A_log and dt_bias
optional), `:softplus` (`-exp(A_log) * softplus(g + dt_bias)`, A_log
required, dt_bias optional) or `:log_decay` (`g`, `UInt16` bf16 or
`Float32`, is the log-decay itself; no A_log, no dt_bias). `beta_mode` is
`:logits` (`sigmoid(beta)`) or `:probabilities`; beta may be bf16 or
`Float32`. Absent tensors are `nothing`. `lower_bound` belongs to the
bounded gate: other gates leave it at -5 (`nothing` means -5) and
`lower_bound(plan)` throws on them.

`layer_step=true` lets `fwd!` take the layer step's convolution
(`conv_weight`; the workspace sizes count what it needs). `decode!` and the
output gate need no flag.
"""
mutable struct Plan
    handle::fkda_plan_t

    function Plan(num_heads; head_dim_k=128, head_dim_v=128, state_dtype=Float32,
                  state_layout=:VK, backend=:auto, lower_bound=-5.0f0,
                  null_slot_rule=:negative, debug_checks=false, gate_mode=:bounded,
                  beta_mode=:logits, chunk_parallel=:auto, segment_chunks=0, layer_step=false)
        desc = fkda_plan_desc(
            Csize_t(sizeof(fkda_plan_desc)),
            to_int32("num_heads", num_heads),
            to_int32("head_dim_k", head_dim_k),
            to_int32("head_dim_v", head_dim_v),
            state_dtype_code(state_dtype),
            choose("state_layout", state_layout, (VK=FKDA_STATE_LAYOUT_VK, KV=FKDA_STATE_LAYOUT_KV)),
            choose("backend", backend, (auto=FKDA_BACKEND_AUTO, cpu=FKDA_BACKEND_CPU, gpu=FKDA_BACKEND_GPU)),
            to_float32("lower_bound", something(lower_bound, DEFAULT_LOWER_BOUND)),
            choose("null_slot_rule", null_slot_rule,
                   (negative=FKDA_NULL_SLOT_NEGATIVE, nonpositive=FKDA_NULL_SLOT_NONPOSITIVE)),
            Int32(to_bool("debug_checks", debug_checks)),
            choose("gate_mode", gate_mode, (bounded=FKDA_GATE_BOUNDED, softplus=FKDA_GATE_SOFTPLUS,
                                            log_decay=FKDA_GATE_LOG_DECAY)),
            choose("beta_mode", beta_mode,
                   (logits=FKDA_BETA_LOGITS, probabilities=FKDA_BETA_PROBABILITIES)),
            Int32(0),
            choose("chunk_parallel", chunk_parallel, (auto=FKDA_CHUNK_PARALLEL_AUTO, off=FKDA_CHUNK_PARALLEL_OFF,
                                                      on=FKDA_CHUNK_PARALLEL_ON)),
            Int64(0),
            Int64(segment_chunks),
            Int32(to_bool("layer_step", layer_step)),
        )
        handle = Ref{fkda_plan_t}(C_NULL)
        check(fkda_plan_create(Ref(desc), handle))
        plan = new(handle[])
        finalizer(destroy_quietly!, plan)
        return plan
    end
end

# FKDA_PLAN_DESC_INIT's lower_bound: what `nothing` stands for, and the value
# plans of the softplus and log-decay gates must keep.
const DEFAULT_LOWER_BOUND = -5.0f0

function choose(name, value, options::NamedTuple)
    value isa Symbol || return to_int32(name, value)
    haskey(options, value) || throw(invalid_argument("$name: unknown value :$value (expected one of $(keys(options)))"))
    return Int32(options[value])
end

state_dtype_code(value::Type) = something(dtype_of(value), FKDA_DTYPE_INVALID)
state_dtype_code(value::Symbol) = choose("state_dtype", value, (bf16=FKDA_DTYPE_BF16, f32=FKDA_DTYPE_F32))
state_dtype_code(value) = to_int32("state_dtype", value)

function live_handle(plan::Plan)
    plan.handle == C_NULL && throw(invalid_argument("plan: used after close()"))
    return plan.handle
end

Base.isopen(plan::Plan) = plan.handle != C_NULL

"""Destroys the plan; closing a closed plan does nothing."""
function Base.close(plan::Plan)
    handle = plan.handle
    handle == C_NULL && return nothing
    plan.handle = C_NULL
    check(fkda_plan_destroy(handle))
    return nothing
end

# Finalizers may not throw or switch tasks.
function destroy_quietly!(plan::Plan)
    handle = plan.handle
    plan.handle = C_NULL
    handle != C_NULL && LIBRARY[] !== nothing && fkda_plan_destroy(handle)
    return nothing
end

"""The backend the plan resolved to: `:cpu` or `:gpu`."""
function backend(plan::Plan)
    value = Ref{fkda_backend}(FKDA_BACKEND_AUTO)
    check(fkda_plan_get_backend(live_handle(plan), value))
    return value[] == FKDA_BACKEND_GPU ? :gpu : :cpu
end

"""The gate floor of a bounded plan (other gates have none: FlashKDAError naming `plan`)."""
function lower_bound(plan::Plan)
    value = Ref{Cfloat}(0)
    check(fkda_get_lower_bound(live_handle(plan), value))
    return value[]
end

function set_lower_bound!(plan::Plan, value)
    check(fkda_set_lower_bound(live_handle(plan), to_float32("lower_bound", value)))
    return plan
end

"""Bytes of workspace `fwd!` needs for `total_tokens` tokens in `num_seqs` sequences."""
workspace_size(plan::Plan, total_tokens::Integer, num_seqs::Integer) =
    size_query(fkda_plan_workspace_size, plan, total_tokens, num_seqs)

"""Bytes of workspace `decode!` needs (0 today; later versions may need some)."""
decode_workspace_size(plan::Plan, total_tokens::Integer, num_seqs::Integer) =
    size_query(fkda_plan_decode_workspace_size, plan, total_tokens, num_seqs)

"""Bytes of workspace `transitions!` needs for these sizes."""
transitions_workspace_size(plan::Plan, total_tokens::Integer, num_seqs::Integer) =
    size_query(fkda_plan_transitions_workspace_size, plan, total_tokens, num_seqs)

function size_query(c_function, plan::Plan, total_tokens::Integer, num_seqs::Integer)
    bytes = Ref{Csize_t}(0)
    check(c_function(live_handle(plan), Int64(total_tokens), Int64(num_seqs), bytes))
    return Int(bytes[])
end

# (total_tokens, num_seqs) from the arrays, or nothing when they are malformed
# (fkda_fwd then names the culprit).
function tokens_and_sequences(q, cu_seqlens)
    q isa AbstractArray && ndims(q) == 4 || return nothing
    batch, seq_len = size(q, 4), size(q, 3)
    cu_seqlens === nothing && return (batch * seq_len, batch)
    cu_seqlens isa AbstractArray && ndims(cu_seqlens) == 1 && length(cu_seqlens) >= 1 || return nothing
    return (batch * seq_len, length(cu_seqlens) - 1)
end

"""
    fwd!(plan, q, k, v, g, beta, scale, out, A_log, dt_bias;
         initial_state=nothing, final_state=nothing, cu_seqlens=nothing,
         state_pool=nothing, state_indices=nothing, has_initial_state=nothing,
         checkpoint_offsets=nothing, checkpoints=nothing, checkpoint_slots=nothing,
         conv_weight=nothing, conv_bias=nothing, conv_state=nothing, out_gate=nothing,
         out_norm_weight=nothing, out_norm_eps=1f-5, workspace=nothing, stream=nothing)

`fkda_fwd`: writes `out` (and `final_state`) in place. Sizes are the C shapes
reversed: q, k, g `(K, H, T, B)`; v, out `(V, H, T, B)`; beta `(H, T, B)`;
A_log `(H,)`; dt_bias `(K, H)`; states `(K, V, H, N)`; cu_seqlens `(N + 1,)`.
States in a pool: `state_pool` `(K, V, H, slots)` updated in place at the
slots `state_indices` `(N,)` (a null index makes its sequence padding);
`has_initial_state` `(N,)` (false starts from zeros); checkpoints after the
token counts `checkpoint_offsets` `(C, N)` go to `checkpoints`
`(K, V, H, C, N)` or to the pool slots `checkpoint_slots` `(C, N)`.
`workspace = nothing` allocates one of `workspace_size` bytes in the arrays'
memory; `stream = nothing` uses CUDA.jl's current stream for CuArrays.
`g` and `beta` may be `Float32` where the plan's gate and beta modes take
them, `A_log` and `dt_bias` `nothing` (see `Plan`).

The layer step around the recurrence (`fkda_layer_step`), every part optional:
- `conv_weight`: q, k and v are then the raw projections, convolved (causal,
  depthwise, width W in 2..4) and passed through SiLU before the recurrence.
  `(wq, wk, wv)`, each `(W, H*K)` (torch's `(W, 1, H*K)` too), `UInt16` bf16
  or `Float32`, or one packed `(W, 3*H*K)` (or `(W, 1, 3*H*K)`) split into
  three views. Needs a plan created with `layer_step=true`.
- `conv_bias`: `(bq, bk, bv)`, `(H*K,)` each, or one packed `(3*H*K,)`.
- `conv_state`: `(sq, sk, sv)`, `(Wc, H*K, rows)` each (Wc = W - 1 or W; rows
  are the sequences, or the pool's slots with `state_indices`), or one packed
  `(Wc, 3*H*K, rows)` (one conv pool, split into its three channel blocks):
  the raw inputs before a sequence's first token,
  read where the sequence reads a recurrent state, updated in place.
- `out_gate` `(V, H, T, B)` bf16 with `out_norm_weight` `(V,)`: the output
  becomes `RMSNorm(o) * out_norm_weight * sigmoid(out_gate)` per head, with
  `out_norm_eps`.
"""
function fwd!(plan::Plan, q, k, v, g, beta, scale, out, A_log, dt_bias;
              initial_state=nothing, final_state=nothing, cu_seqlens=nothing,
              state_pool=nothing, state_indices=nothing, has_initial_state=nothing,
              checkpoint_offsets=nothing, checkpoints=nothing, checkpoint_slots=nothing,
              conv_weight=nothing, conv_bias=nothing, conv_state=nothing, out_gate=nothing,
              out_norm_weight=nothing, out_norm_eps=DEFAULT_OUT_NORM_EPS,
              workspace=nothing, stream=nothing)
    arrays = (q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, out=out,
              initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens)
    pool = (state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
            checkpoint_offsets=checkpoint_offsets, checkpoints=checkpoints,
            checkpoint_slots=checkpoint_slots)
    layer = layer_arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight)
    args = fkda_fwd_args(Csize_t(sizeof(fkda_fwd_args)), tensors_of(arrays)...,
                         to_float32("scale", scale), tensors_of(pool)...,
                         layer_step_of(layer, out_norm_eps))
    enqueue!(fkda_fwd, args, workspace_size, plan, merge(arrays, pool, layer), workspace, stream)
    return out
end

"""
    decode!(plan, q, k, v, g, beta, scale, out, A_log, dt_bias, state_pool, state_indices;
            num_accepted_tokens=nothing, cu_seqlens=nothing, conv_weight=nothing,
            conv_bias=nothing, conv_state=nothing, out_gate=nothing, out_norm_weight=nothing,
            out_norm_eps=1f-5, workspace=nothing, stream=nothing)

`fkda_decode`: 1 to 16 tokens per sequence on states in a pool, writing `out`
and updating `state_pool` `(K, V, H, slots)` in place. q, k, g, v, out
`(K, H, T, N)` (T <= 16), or packed `(K, H, total, 1)` with cu_seqlens
`(N + 1,)`; beta `(H, T, N)`. `state_indices` `(N,)` reads and writes one slot
per sequence; `(W, N)` (speculative verify) starts from row
`num_accepted_tokens[n]` and writes the state after token t to row t + 1.
A sequence whose starting index is null (the plan's `null_slot_rule`) is
padding: zero output, no state touched. The layer step's keywords are those
of `fwd!` (no plan flag needed); the conv states' rows are pool slots, read
and updated with the recurrent state (an `(W, N)` slot table takes no
convolution).
"""
function decode!(plan::Plan, q, k, v, g, beta, scale, out, A_log, dt_bias, state_pool, state_indices;
                 num_accepted_tokens=nothing, cu_seqlens=nothing, conv_weight=nothing,
                 conv_bias=nothing, conv_state=nothing, out_gate=nothing, out_norm_weight=nothing,
                 out_norm_eps=DEFAULT_OUT_NORM_EPS, workspace=nothing, stream=nothing)
    arrays = (q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, out=out,
              state_pool=state_pool, state_indices=state_indices,
              num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens)
    layer = layer_arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight)
    args = fkda_decode_args(Csize_t(sizeof(fkda_decode_args)), tensors_of(arrays)...,
                            to_float32("scale", scale), layer_step_of(layer, out_norm_eps))
    enqueue!(fkda_decode, args, decode_workspace_size, plan, merge(arrays, layer), workspace, stream)
    return out
end

tensors_of(arrays::NamedTuple) = map(name -> tensor_of(String(name), arrays[name]), keys(arrays))

# The layer step's arrays by the names of fkda_layer_step's tensors. The
# convolution's arguments come per projection, `(q, k, v)`, or packed: one
# array of 3*H*K channels split into three views (so packed states are still
# updated in place).
function layer_arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight)
    wq, wk, wv = map(as_matrix, projections("conv_weight", as_matrix(conv_weight), 2))
    bq, bk, bv = projections("conv_bias", conv_bias, 1)
    sq, sk, sv = projections("conv_state", conv_state, 2)
    return (conv_weight_q=wq, conv_weight_k=wk, conv_weight_v=wv, conv_bias_q=bq, conv_bias_k=bk,
            conv_bias_v=bv, conv_state_q=sq, conv_state_k=sk, conv_state_v=sv, out_gate=out_gate,
            out_norm_weight=out_norm_weight)
end

layer_step_of(layer::NamedTuple, out_norm_eps) =
    fkda_layer_step(tensors_of(layer)..., to_float32("out_norm_eps", out_norm_eps), Int32(0))

# torch's (W, 1, C) convolution weight (its [C, 1, W] in Julia order) as the (W, C) the library takes.
as_matrix(weight::AbstractArray) = ndims(weight) == 3 && size(weight, 2) == 1 ? view(weight, :, 1, :) : weight
as_matrix(weight) = weight

# (q, k, v) of a convolution argument: nothing, three arrays, or one packed
# array whose channels (dimension `dim`) split into thirds.
projections(name, ::Nothing, dim) = (nothing, nothing, nothing)
function projections(name, arrays::Union{Tuple,AbstractVector{<:AbstractArray}}, dim)
    length(arrays) == 3 && return (arrays[1], arrays[2], arrays[3])
    length(arrays) == 1 && return projections(name, only(arrays), dim)
    throw(invalid_argument("$name: expected three arrays (q, k, v) or one packed array, got $(length(arrays))"))
end
function projections(name, packed::AbstractArray, dim)
    ndims(packed) >= dim || throw(invalid_argument(
        "$name: a packed array of $(ndims(packed)) dimensions has no channel dimension $dim"))
    channels = size(packed, dim)
    channels % 3 == 0 || throw(invalid_argument(
        "$name: $channels channels in dimension $dim do not split into q, k and v (expected 3*H*K)"))
    third = channels ÷ 3
    return ntuple(i -> selectdim(packed, dim, (i - 1) * third + 1:i * third), 3)
end
projections(name, value, dim) =
    throw(invalid_argument("$name: expected three arrays (q, k, v) or one packed array, got $(typeof(value))"))

"""
    raw_layer_step(; conv_weight=nothing, conv_bias=nothing, conv_state=nothing,
                   out_gate=FKDA_TENSOR_NONE, out_norm_weight=FKDA_TENSOR_NONE,
                   out_norm_eps=1f-5) -> fkda_layer_step

The layer step for `fwd_raw!` from `fkda_tensor` descriptors (`tensor`):
`conv_weight`, `conv_bias` and `conv_state` are tuples `(q, k, v)` of them.
"""
function raw_layer_step(; conv_weight=nothing, conv_bias=nothing, conv_state=nothing,
                        out_gate::fkda_tensor=FKDA_TENSOR_NONE,
                        out_norm_weight::fkda_tensor=FKDA_TENSOR_NONE,
                        out_norm_eps=DEFAULT_OUT_NORM_EPS)
    three(::Nothing) = (FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE)
    three(tensors::NTuple{3,fkda_tensor}) = tensors
    wq, wk, wv = three(conv_weight)
    bq, bk, bv = three(conv_bias)
    sq, sk, sv = three(conv_state)
    return fkda_layer_step(wq, wk, wv, bq, bk, bv, sq, sk, sv, out_gate, out_norm_weight,
                           to_float32("out_norm_eps", out_norm_eps), Int32(0))
end

# Calls `c_function` (fkda_fwd or fkda_decode) with `args`, a workspace sized
# by `size_query` unless one is given, on the arrays' device and stream.
function enqueue!(c_function, args, size_query, plan::Plan, arrays::NamedTuple, workspace, stream)
    handle = live_handle(plan)
    lead = something(values(arrays)..., missing)
    kind = lead === missing ? :host : memory_kind(lead)
    plan_memory = backend(plan) == :gpu ? :device : :host
    # Arrays in the wrong memory for the plan are the call's to report, by
    # name, before anything about the workspace.
    arrays_fit_the_plan = lead !== missing && kind == plan_memory
    if workspace === nothing && arrays_fit_the_plan
        sizes = tokens_and_sequences(get(arrays, :q, get(arrays, :k, nothing)), get(arrays, :cu_seqlens, nothing))
        bytes = 0
        if sizes !== nothing
            bytes = try
                size_query(plan, sizes...)
            catch error
                error isa FlashKDAError || rethrow()
                0  # the call names the malformed argument
            end
        end
        workspace = bytes > 0 ? allocate_workspace(Val(kind), bytes, lead) : nothing
    end
    workspace_pointer, workspace_bytes = C_NULL, 0
    if workspace !== nothing
        memory_kind(workspace) === nothing && throw(invalid_argument(
            "workspace: $(typeof(workspace)) is neither a strided host array nor a CuArray"))
        # The library checks the workspace's size and alignment, not where it lives.
        if arrays_fit_the_plan && memory_kind(workspace) != plan_memory
            throw(invalid_argument("workspace: $(typeof(workspace)) is not $plan_memory memory, " *
                                   "which the plan's backend needs"))
        end
        workspace_pointer = data_pointer(workspace)
        workspace_bytes = sizeof(workspace)
    end

    GC.@preserve arrays workspace begin
        status = on_device_of(Val(kind), lead) do
            raw_stream = stream === nothing ? default_stream(Val(kind), lead) : stream_handle(stream)
            c_function(handle, Ref(args), workspace_pointer, Csize_t(workspace_bytes), raw_stream)
        end
        check(status)
    end
    return nothing
end

"""
    transitions!(plan, k, v, g, beta, A_log, dt_bias, transition_m, transition_e;
                 cu_seqlens=nothing, workspace=nothing, stream=nothing)

`fkda_transitions`: each sequence's segment transition, the map
`S_out = S_in M + E` of its tokens, written into `transition_m` `(K, K, H, N)`
and `transition_e` `(K, V, H, N)` (Float32; the C shapes reversed, as
everywhere here). Inputs as for `fwd!` (no q, no out).
"""
function transitions!(plan::Plan, k, v, g, beta, A_log, dt_bias, transition_m, transition_e;
                      cu_seqlens=nothing, workspace=nothing, stream=nothing)
    arrays = (k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
              transition_m=transition_m, transition_e=transition_e)
    args = fkda_transition_args(Csize_t(sizeof(fkda_transition_args)), tensors_of(arrays)...)
    enqueue!(fkda_transitions, args, transitions_workspace_size, plan, arrays, workspace, stream)
    return transition_m
end

"""
    apply_transitions!(plan, transition_m, transition_e, final_state; initial_state=nothing, stream=nothing)

`fkda_apply_transitions`: transitions `(K, K, H, N, R)` and `(K, V, H, N, R)`
applied in order (r = 1 first) to `initial_state` `(K, V, H, N)` (`nothing`:
zeros), into `final_state` (which may be `initial_state` itself).
"""
function apply_transitions!(plan::Plan, transition_m, transition_e, final_state;
                            initial_state=nothing, stream=nothing)
    arrays = (transition_m=transition_m, transition_e=transition_e, initial_state=initial_state,
              final_state=final_state)
    args = fkda_apply_args(Csize_t(sizeof(fkda_apply_args)), tensors_of(arrays)...)
    enqueue!(fkda_apply_transitions, args, (plan, tokens, seqs) -> 0, plan, arrays, nothing, stream)
    return final_state
end

"""
    fwd_raw!(plan, q, k, v, g, beta, scale, out, A_log, dt_bias;
             initial_state=FKDA_TENSOR_NONE, final_state=FKDA_TENSOR_NONE,
             cu_seqlens=FKDA_TENSOR_NONE, workspace=C_NULL, workspace_bytes=0,
             stream=C_NULL, state_pool=FKDA_TENSOR_NONE, ..., layer=FKDA_LAYER_STEP_INIT)

`fkda_fwd` with `fkda_tensor` descriptors from `tensor(pointer, dims)`; the
pool keywords (state_pool, state_indices, has_initial_state,
checkpoint_offsets, checkpoints, checkpoint_slots) are descriptors too, and
`layer` the layer step (`raw_layer_step`).
`A_log` and `dt_bias` are `FKDA_TENSOR_NONE` where the plan's gate takes them absent.
Unsafe: nothing here can check that the pointers are valid for the shapes
they are described with, readable, and (for `out`, `final_state`, the pool
and the checkpoints) writable until the work completes on `stream`.
"""
function fwd_raw!(plan::Plan, q::fkda_tensor, k::fkda_tensor, v::fkda_tensor, g::fkda_tensor,
                  beta::fkda_tensor, scale, out::fkda_tensor, A_log::fkda_tensor, dt_bias::fkda_tensor;
                  initial_state::fkda_tensor=FKDA_TENSOR_NONE, final_state::fkda_tensor=FKDA_TENSOR_NONE,
                  cu_seqlens::fkda_tensor=FKDA_TENSOR_NONE, workspace=C_NULL, workspace_bytes::Integer=0,
                  stream=C_NULL, state_pool::fkda_tensor=FKDA_TENSOR_NONE,
                  state_indices::fkda_tensor=FKDA_TENSOR_NONE,
                  has_initial_state::fkda_tensor=FKDA_TENSOR_NONE,
                  checkpoint_offsets::fkda_tensor=FKDA_TENSOR_NONE,
                  checkpoints::fkda_tensor=FKDA_TENSOR_NONE,
                  checkpoint_slots::fkda_tensor=FKDA_TENSOR_NONE,
                  layer::fkda_layer_step=FKDA_LAYER_STEP_INIT)
    args = fkda_fwd_args(Csize_t(sizeof(fkda_fwd_args)), q, k, v, g, beta, A_log, dt_bias, out,
                         initial_state, final_state, cu_seqlens, to_float32("scale", scale),
                         state_pool, state_indices, has_initial_state, checkpoint_offsets,
                         checkpoints, checkpoint_slots, layer)
    check(fkda_fwd(live_handle(plan), Ref(args), raw_pointer(workspace), Csize_t(workspace_bytes),
                   stream_handle(stream)))
    return nothing
end

"""
    fwd!(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound;
         initial_state=nothing, final_state=nothing, cu_seqlens=nothing,
         state_pool=nothing, state_indices=nothing, has_initial_state=nothing,
         checkpoint_offsets=nothing, checkpoints=nothing, checkpoint_slots=nothing,
         null_slot_rule=:negative, gate_mode=:bounded, beta_mode=:logits,
         conv_weight=nothing, conv_bias=nothing, conv_state=nothing, out_gate=nothing,
         out_norm_weight=nothing, out_norm_eps=1f-5)

The forward pass with the arguments of FlashKDA's `flash_kda.fwd`, through a
temporary plan: host arrays run on the CPU backend, CuArrays on the GPU; the
state dtype follows the states given (Float32 when none). The pool and layer
step arguments are those of `fwd!(plan, ...)` (the plan is created with
`layer_step` when `conv_weight` is given); `gate_mode` and `beta_mode` those
of `Plan` (`lower_bound`, `A_log` and `dt_bias` may then be `nothing`).
"""
function fwd!(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound;
              initial_state=nothing, final_state=nothing, cu_seqlens=nothing,
              state_pool=nothing, state_indices=nothing, has_initial_state=nothing,
              checkpoint_offsets=nothing, checkpoints=nothing, checkpoint_slots=nothing,
              null_slot_rule=:negative, gate_mode=:bounded, beta_mode=:logits,
              conv_weight=nothing, conv_bias=nothing, conv_state=nothing, out_gate=nothing,
              out_norm_weight=nothing, out_norm_eps=DEFAULT_OUT_NORM_EPS)
    with_temporary_plan(q, A_log, something(initial_state, final_state, state_pool, missing),
                        lower_bound, null_slot_rule, gate_mode, beta_mode;
                        layer_step=conv_weight !== nothing) do plan
        fwd!(plan, q, k, v, g, beta, scale, out, A_log, dt_bias;
             initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens,
             state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
             checkpoint_offsets=checkpoint_offsets, checkpoints=checkpoints,
             checkpoint_slots=checkpoint_slots, conv_weight=conv_weight, conv_bias=conv_bias,
             conv_state=conv_state, out_gate=out_gate, out_norm_weight=out_norm_weight,
             out_norm_eps=out_norm_eps)
    end
    return out
end

"""
    decode!(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, state_pool, state_indices;
            num_accepted_tokens=nothing, cu_seqlens=nothing, null_slot_rule=:negative,
            gate_mode=:bounded, beta_mode=:logits, conv_weight=nothing, conv_bias=nothing,
            conv_state=nothing, out_gate=nothing, out_norm_weight=nothing, out_norm_eps=1f-5)

`decode!(plan, ...)` through a temporary plan whose state dtype is the pool's.
"""
function decode!(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, state_pool, state_indices;
                 num_accepted_tokens=nothing, cu_seqlens=nothing, null_slot_rule=:negative,
                 gate_mode=:bounded, beta_mode=:logits, conv_weight=nothing, conv_bias=nothing,
                 conv_state=nothing, out_gate=nothing, out_norm_weight=nothing,
                 out_norm_eps=DEFAULT_OUT_NORM_EPS)
    with_temporary_plan(q, A_log, something(state_pool, missing), lower_bound, null_slot_rule,
                        gate_mode, beta_mode) do plan
        decode!(plan, q, k, v, g, beta, scale, out, A_log, dt_bias, state_pool, state_indices;
                num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
                conv_weight=conv_weight, conv_bias=conv_bias, conv_state=conv_state,
                out_gate=out_gate, out_norm_weight=out_norm_weight, out_norm_eps=out_norm_eps)
    end
    return out
end

# Runs f(plan) on a plan made for q's memory, q's (or A_log's) head count and
# the state's dtype, closed afterwards.
function with_temporary_plan(f, q, A_log, state, lower_bound, null_slot_rule, gate_mode, beta_mode;
                             layer_step=false)
    lead = something(q, A_log, missing)
    kind = lead === missing ? :host : something(memory_kind(lead), :host)
    num_heads = q isa AbstractArray && ndims(q) == 4 ? size(q, 2) :
                A_log isa AbstractArray && ndims(A_log) == 1 ? length(A_log) : 1
    state_dtype = state === missing ? Float32 :
                  dtype_of(eltype(state)) in (FKDA_DTYPE_BF16, FKDA_DTYPE_F32) ? eltype(state) : Float32
    plan = Plan(num_heads; state_dtype=state_dtype, backend=kind == :device ? :gpu : :cpu,
                lower_bound=lower_bound, null_slot_rule=null_slot_rule, gate_mode=gate_mode,
                beta_mode=beta_mode, layer_step=layer_step)
    try
        f(plan)
    finally
        close(plan)
    end
end

# ------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------

"""
    query_device(device=-1) -> NamedTuple

`fkda_query_device`: device `device`, or with -1 the current one (else 0).
Succeeds without a driver or GPU; throws, naming both versions, with a driver
older than `build_info().min_driver_version`.
"""
function query_device(device::Integer=-1)
    info = Ref(fkda_device_info(Csize_t(sizeof(fkda_device_info)), 0, 0, 0, -1, 0, 0, 0,
                                ntuple(_ -> Cchar(0), 256)))
    check(fkda_query_device(to_int32("device", device), info))
    i = info[]
    return (driver_loaded=i.driver_loaded != 0, driver_version=Int(i.driver_version),
            device_count=Int(i.device_count), device=Int(i.device), cc_major=Int(i.cc_major),
            cc_minor=Int(i.cc_minor), has_kernels=i.has_kernels != 0, name=c_string(i.name))
end

"""
    build_info() -> NamedTuple

`fkda_get_build_info`: the CUDA version the kernels were compiled with, the
oldest driver that loads them (both as `cuDriverGetVersion` encodes them,
12.9 is 12090) and the images in the fatbin ("sm_80 sm_90a compute_90").
"""
function build_info()
    info = Ref(fkda_build_info(Csize_t(sizeof(fkda_build_info)), 0, 0, ntuple(_ -> Cchar(0), 64)))
    check(fkda_get_build_info(info))
    i = info[]
    return (cuda_version=Int(i.cuda_version), min_driver_version=Int(i.min_driver_version),
            architectures=c_string(i.architectures))
end

# A NUL-terminated char array of a struct as a String.
function c_string(chars::NTuple{N,Cchar}) where {N}
    bytes = UInt8[reinterpret(UInt8, c) for c in chars]
    return String(bytes[1:something(findfirst(==(0x00), bytes), N + 1)-1])
end

# ------------------------------------------------------------------------
# bf16
# ------------------------------------------------------------------------

"""Float -> bf16 bit patterns, rounding to nearest even; NaN stays NaN (quiet, sign kept)."""
function to_bf16(value::AbstractFloat)
    x = Float32(value)
    bits = reinterpret(UInt32, x)
    isnan(x) && return UInt16((bits >> 16) | 0x0040)
    # No carry out of 32 bits for non-NaN values: the largest is -Inf + 0x8000.
    return UInt16((bits + 0x00007fff + ((bits >> 16) & 0x00000001)) >> 16)
end
to_bf16(values::AbstractArray{<:AbstractFloat}) = map(to_bf16, values)

"""bf16 bit patterns -> Float32 (exact)."""
from_bf16(bits::UInt16) = reinterpret(Float32, UInt32(bits) << 16)
from_bf16(values::AbstractArray{UInt16}) = map(from_bf16, values)
@static if isdefined(Core, :BFloat16)
    from_bf16(value::Core.BFloat16) = from_bf16(reinterpret(UInt16, value))
    from_bf16(values::AbstractArray{Core.BFloat16}) = map(from_bf16, values)
end

end # module
