/* SPDX-License-Identifier: MIT */
// The buffers of one run, in device memory or (for --cpu runs) in host
// memory, behind the same calls, so that a case is set up and checked by one
// piece of code on either backend.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "bench_support.h"
#include "flashkda.h"

namespace fkda_bench {

class RunMemory {
 public:
  explicit RunMemory(bool on_device) : on_device_(on_device) {}
  bool on_device() const { return on_device_; }

  // A buffer owned by this object, uninitialised; zero bytes gives nullptr.
  void* allocate(size_t bytes);
  // allocate() holding a copy of `src`.
  void* place(const void* src, size_t bytes);
  void write(void* dst, const void* src, size_t bytes) const;
  void fill(void* dst, unsigned char byte, size_t bytes) const;
  std::vector<unsigned char> read(const void* src, size_t bytes) const;

 private:
  bool on_device_;
  // Buffer addresses stay put when these vectors grow.
  std::vector<DeviceBuffer> device_;
  std::vector<std::unique_ptr<unsigned char[]>> host_;
};

// Every element of a bf16 or f32 buffer's bytes is finite (all-ones poison
// bytes are NaN in both, so unwritten elements fail this).
bool all_finite(const std::vector<unsigned char>& bytes, bool is_f32);

// The values of a bf16 or f32 buffer's bytes as floats.
std::vector<float> widen_to_float(const std::vector<unsigned char>& bytes, fkda_dtype dtype);

}  // namespace fkda_bench
