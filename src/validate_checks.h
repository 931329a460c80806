/* SPDX-License-Identifier: MIT */
// The generic argument checks (validate_tensors.cpp) that the validation of
// each entry point builds on: validate_fwd.cpp, validate_decode.cpp and any
// later one. They look at descriptors only, never at the contents of
// indices or offsets (validate_contents.cpp). Each throws fkda::Error with a
// message that starts with the argument's name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "dtype_name.h"
#include "error.h"
#include "flashkda.h"
#include "plan.h"
#include "prefill_problem.h"

namespace fkda::checks {

int64_t element_bytes(int32_t dtype);
std::string join(const int64_t* values, int32_t count);

// Expected extents; kAny accepts any non-negative extent (the first tensor
// to mention an axis fixes it for the others).
constexpr int64_t kAny = -1;

bool present(const fkda_tensor& t);

// A tensor with a zero extent holds no element: nothing of it is read or
// written, so its data pointer, strides and alignment are never looked at.
// Call after the rank and extents are checked.
bool is_empty(const fkda_tensor& t);

// What a tensor's strides must be: fully packed (row-major), packed along
// the last axis only (rows of a strided view), or anything non-negative.
enum class Strides { kPacked, kRows, kFree };

// Dtype, rank, extents, strides, span and alignment of one tensor, by the
// rules of flashkda.h's fkda_tensor.
void check_tensor(const fkda_tensor& t, const char* name, std::initializer_list<int32_t> dtypes,
                  std::initializer_list<int64_t> shape, Strides strides);

// A tensor the call writes must not map two elements to one address
// (empty tensors pass).
void check_no_overlap(const fkda_tensor& t, const char* name);

// The stride the backends address an axis with: its own, or 0 where it
// cannot matter and is not checked (an axis of extent 1, an empty tensor).
int64_t used_stride(const fkda_tensor& t, int32_t axis);

ActView act_view(const fkda_tensor& t);

// GPU kernels move rows of 8 bf16 in 16-byte accesses.
void check_gpu_alignment(const fkda_tensor& t, const char* name);

// The arguments a check walks, held in place, so that a valid call
// allocates nothing on its way to the launch. kMaxCallArgs bounds every
// entry point's list (fkda_fwd's, the longest, has 30).
constexpr size_t kMaxCallArgs = 32;
template <class T>
class ArgList {
 public:
  ArgList(std::initializer_list<T> items) {
    for (const T& item : items) push_back(item);
  }
  void push_back(const T& item) {
    if (count_ == kMaxCallArgs) fail(FKDA_ERROR_INTERNAL, "more arguments than kMaxCallArgs to check");
    items_[count_++] = item;
  }
  const T* begin() const { return items_; }
  const T* end() const { return items_ + count_; }
  size_t size() const { return count_; }
  const T& operator[](size_t i) const { return items_[i]; }

 private:
  T items_[kMaxCallArgs] = {};
  size_t count_ = 0;
};

struct Located {
  const void* data;
  const char* name;
};

// Host memory for CPU plans, memory of the current context's device for GPU plans.
void check_residency(const Plan& plan, const ArgList<Located>& pointers);

// Host-readable offsets (CPU plans, and GPU debug checks): 0 = cu[0] <=
// cu[1] <= ... <= cu[N] = T. In validate_contents.cpp with the other
// content checks.
void check_cu_seqlens_contents(const fkda_tensor& cu, int64_t total_tokens);

// The activations and parameters fkda_fwd and fkda_decode share, in their
// common argument order. q fixes B and T; the others are checked against them.
struct Activations {
  const fkda_tensor &q, &k, &v, &g, &beta, &A_log, &dt_bias, &out;
};
struct ActivationExtents {
  int64_t batch, tokens;
};
ActivationExtents check_activations(const Plan& plan, const Activations& a);

// g, beta, A_log and dt_bias under the plan's gate and beta modes (fkda_fwd,
// fkda_decode and fkda_transitions alike).
struct GateInputs {
  const fkda_tensor &g, &beta, &A_log, &dt_bias;
};
void check_gate_inputs(const Plan& plan, const GateInputs& inputs, int64_t batch, int64_t tokens);

// cu_seqlens' rank, dtype and stride; returns N (B without cu_seqlens).
int64_t check_cu_seqlens(const fkda_tensor& cu, int64_t batch);

// The axes from `first_packed` on must be packed (the [H, V, K] of a state);
// the axes before it are free but must not make elements overlap.
void check_packed_from(const fkda_tensor& t, const char* name, int32_t first_packed);

// Up to FKDA_MAX_RANK extents, held in place (no allocation on a call's path).
struct Extents {
  int64_t at[FKDA_MAX_RANK] = {};
  int32_t rank = 0;
  int64_t operator[](int32_t axis) const { return at[axis]; }
};

// The state shape of the plan's layout after the given leading extents:
// {leading..., H, V, K} or {leading..., H, K, V}.
Extents state_shape(const Plan& plan, std::initializer_list<int64_t> leading);

// Rank and extents only (kAny matches any extent).
void check_shape(const fkda_tensor& t, const char* name, const Extents& shape);

// A pool of states in the plan's dtype and layout, [slots, H, V, K] (or KV):
// the slot stride free, each state contiguous.
PoolView check_pool(const Plan& plan, const fkda_tensor& t, const char* name = "state_pool");

// [rows] (cols == 0) or [rows, cols] (cols may be kAny) i32 or i64 integers,
// with allow_bool also bool; any strides. An absent tensor gives an absent view.
IndexView check_indices(const fkda_tensor& t, const char* name, int64_t rows, int64_t cols,
                        bool allow_bool = false);
IndexView index_view(const fkda_tensor& t);

// GPU plans: check_gpu_alignment on each present, non-empty tensor.
struct Named {
  const fkda_tensor* tensor;
  const char* name;
};
void check_gpu_rows(const Plan& plan, const ArgList<Named>& tensors);

// A call's workspace: at least `required` bytes (else
// FKDA_ERROR_WORKSPACE_TOO_SMALL, the message naming `sizes` and the
// `size_call` that answers them), non-NULL and 16-byte aligned when any is needed.
void check_workspace(const void* workspace, size_t workspace_bytes, size_t required, const std::string& sizes,
                     const char* size_call);

// One piece of memory a call touches: a tensor argument's bytes from its
// first to its last element, or the workspace the call uses.
struct Operand {
  const char* name;
  uintptr_t first = 0, last = 0;  // [first, last); first == last: nothing
  bool written = false;

  static Operand tensor(const fkda_tensor& t, const char* name, bool written);
  static Operand bytes(const void* data, size_t size, const char* name, bool written);
};

// Memory a call writes is shared with no other operand: each written
// operand is checked against every other one, written or read, by their
// byte spans. `in_place` lists pairs (read, written) that may instead be
// the very same memory, same first and last byte (a state updated in
// place); partly overlapping is an error all the same. The message names
// the written operand (of two written ones, the later in the list).
void check_no_shared_memory(const ArgList<Operand>& operands,
                            std::initializer_list<std::pair<const char*, const char*>> in_place = {});

// The fields every problem shares (RecurrenceCall), from checked arguments.
void fill_recurrence_call(const Plan& plan, const Activations& a, const fkda_tensor& cu_seqlens, int64_t batch,
                          int64_t tokens, int64_t num_seqs, float scale, RecurrenceCall& call);

}  // namespace fkda::checks
