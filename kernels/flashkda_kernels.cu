// SPDX-License-Identifier: MIT
// The single nvcc translation unit of libflashkda: every kernel, compiled into
// one fatbin (sm_80 and sm_90a machine code, compute_90 PTX) that the library
// embeds and loads through the driver. Kernels are looked up by their
// extern "C" names from src/gpu/kernel_library.cpp.
#include "decode_params.h"
#include "prefill_params.h"
#include "prefill_prepare.cuh"
#include "prefill_recurrence.cuh"
#include "decode_recurrence.cuh"
#include "decode_streamed.cuh"
#include "prefill_scan.cuh"
#include "layer_step.cuh"
