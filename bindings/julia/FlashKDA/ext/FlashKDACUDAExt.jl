# SPDX-License-Identifier: MIT
# CuArrays and CuPtrs for FlashKDA: loaded with CUDA.jl.
#
# CuArrays describe device memory for the GPU backend. Calls run with the
# arrays' device made current for the task (the library uses the calling
# thread's current context) and launch on CUDA.jl's stream of the current
# task, so they order with the task's other work. Workspaces come from
# CUDA.jl's allocator on that device.
module FlashKDACUDAExt

using CUDA
using FlashKDA

# The CuArray a (possibly nested) strided view is backed by.
backing_array(array::CuArray) = array
backing_array(array::SubArray) = backing_array(parent(array))

# CuArrays are DenseArrays too: these methods must be more specific than
# FlashKDA's StridedArray ones, hence CuArray itself next to StridedCuArray.
FlashKDA.memory_kind(::CuArray) = :device
FlashKDA.memory_kind(::CUDA.StridedCuArray) = :device

FlashKDA.data_pointer(array::CuArray) = FlashKDA.raw_pointer(pointer(array))
FlashKDA.data_pointer(array::CUDA.StridedCuArray) = FlashKDA.raw_pointer(pointer(array))

FlashKDA.raw_pointer(pointer::CuPtr) = Ptr{Cvoid}(reinterpret(UInt, pointer))

function FlashKDA.on_device_of(f, ::Val{:device}, like)
    CUDA.device!(CUDA.device(backing_array(like))) do
        # device! switches the task's device; this binds its context to the
        # OS thread the library will see, as CUDA.jl does before its own calls.
        if isdefined(CUDA, :prepare_cuda_state)
            CUDA.prepare_cuda_state()
        end
        f()
    end
end

FlashKDA.default_stream(::Val{:device}, like) = FlashKDA.fkda_stream_t(UInt(CUDA.stream().handle))

FlashKDA.stream_handle(stream::CuStream) = FlashKDA.fkda_stream_t(UInt(stream.handle))

function FlashKDA.allocate_workspace(::Val{:device}, bytes, like)
    CUDA.device!(CUDA.device(backing_array(like))) do
        CuArray{UInt8}(undef, bytes)
    end
end

# Device descriptors for fwd_raw! from raw CuPtrs.
FlashKDA.tensor(pointer::CuPtr{T}, dims::Dims; strides=nothing) where {T} =
    FlashKDA.tensor_from_pointer(FlashKDA.raw_pointer(pointer), T, dims, strides)

end # module
