// SPDX-License-Identifier: MIT
#include "run_memory.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kda_reference.h"

namespace fkda_bench {

void* RunMemory::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (on_device_) {
    device_.emplace_back(bytes);
    return device_.back().get();
  }
  host_.emplace_back(new unsigned char[bytes]);
  return host_.back().get();
}

void* RunMemory::place(const void* src, size_t bytes) {
  void* dst = allocate(bytes);
  write(dst, src, bytes);
  return dst;
}

void RunMemory::write(void* dst, const void* src, size_t bytes) const {
  if (bytes == 0) return;
  if (on_device_)
    FKDA_BENCH_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  else
    std::memcpy(dst, src, bytes);
}

void RunMemory::fill(void* dst, unsigned char byte, size_t bytes) const {
  if (bytes == 0) return;
  if (on_device_)
    FKDA_BENCH_CUDA(cudaMemset(dst, byte, bytes));
  else
    std::memset(dst, byte, bytes);
}

std::vector<unsigned char> RunMemory::read(const void* src, size_t bytes) const {
  std::vector<unsigned char> out(bytes);
  if (bytes == 0) return out;
  if (on_device_)
    FKDA_BENCH_CUDA(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost));
  else
    std::memcpy(out.data(), src, bytes);
  return out;
}

bool all_finite(const std::vector<unsigned char>& bytes, bool is_f32) {
  if (is_f32) {
    for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
      float x;
      std::memcpy(&x, &bytes[i], 4);
      if (!std::isfinite(x)) return false;
    }
  } else {
    for (size_t i = 0; i + 2 <= bytes.size(); i += 2) {
      uint16_t bits;
      std::memcpy(&bits, &bytes[i], 2);
      if ((bits & 0x7F80u) == 0x7F80u) return false;  // exponent all ones: inf or NaN
    }
  }
  return true;
}

std::vector<float> widen_to_float(const std::vector<unsigned char>& bytes, fkda_dtype dtype) {
  if (dtype == FKDA_DTYPE_F32) {
    std::vector<float> values(bytes.size() / 4);
    std::memcpy(values.data(), bytes.data(), values.size() * 4);
    return values;
  }
  std::vector<uint16_t> bits(bytes.size() / 2);
  std::memcpy(bits.data(), bytes.data(), bits.size() * 2);
  return fkda_ref::bf16_to_float(bits);
}

}  // namespace fkda_bench
