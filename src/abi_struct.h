/* SPDX-License-Identifier: MIT */
// Versioned ABI structs: the caller's struct_size says which header it was
// built against. The rule is that of the Linux kernel's extensible structs
// (copy_struct_from_user): a size some release of flashkda.h had is read as
// that release, with the fields it lacks at their _INIT values; a size larger
// than this library's is accepted only when every byte past the fields the
// library knows is zero (a newer caller that sets no new field); any other
// size is an error. Output structs are written by the same table, never past the fields
// of the caller's release.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "error.h"
#include "flashkda.h"

namespace fkda {

// One published layout of a struct. `fields_end` is where its last field
// ends; `size` its sizeof, which may add trailing padding, and a later
// release's first field may sit in that padding (0.3's gate_mode in 0.2's
// fkda_plan_desc, 0.4's vsplit in 0.3's), so a caller of that size has only
// `fields_end` bytes of fields.
struct StructRelease {
  const char* version;  // the release that introduced this layout
  size_t size;
  size_t fields_end;
};

// How far past this library's size a newer caller's struct may reach. The
// bytes between are read (they must be zero), so the bound keeps a garbage
// struct_size from sending the check through unmapped memory; clone3 bounds
// its struct by a page the same way.
constexpr size_t kMaxStructGrowth = 4096;

// The release table of each versioned struct. The sizes are those of the
// LP64 ABI the library is built for; tests/unit/test_abi.cpp recomputes
// each from flashkda.h with offsetof. A release that changes nothing in a
// struct has no row: the rows are the sizes a caller can have.
template <typename Struct>
struct AbiStruct;

template <>
struct AbiStruct<fkda_plan_desc> {
  static constexpr const char* name = "fkda_plan_desc";
  static constexpr const char* init_macro = "FKDA_PLAN_DESC_INIT";
  static constexpr StructRelease releases[] = {{"0.1", 40, 36}, {"0.2", 48, 44}, {"0.3", 56, 52}, {"0.4", 80, 80}, {"0.5", 88, 84}};
  static fkda_plan_desc init() { return FKDA_PLAN_DESC_INIT; }
};

template <>
struct AbiStruct<fkda_fwd_args> {
  static constexpr const char* name = "fkda_fwd_args";
  static constexpr const char* init_macro = "FKDA_FWD_ARGS_INIT";
  static constexpr StructRelease releases[] = {{"0.1", 1248, 1244}, {"0.2", 1920, 1920}, {"0.5", 3160, 3160}};
  static fkda_fwd_args init() { return FKDA_FWD_ARGS_INIT; }
};

template <>
struct AbiStruct<fkda_decode_args> {
  static constexpr const char* name = "fkda_decode_args";
  static constexpr const char* init_macro = "FKDA_DECODE_ARGS_INIT";
  static constexpr StructRelease releases[] = {{"0.2", 1360, 1356}, {"0.5", 2600, 2600}};
  static fkda_decode_args init() { return FKDA_DECODE_ARGS_INIT; }
};

template <>
struct AbiStruct<fkda_transition_args> {
  static constexpr const char* name = "fkda_transition_args";
  static constexpr const char* init_macro = "FKDA_TRANSITION_ARGS_INIT";
  static constexpr StructRelease releases[] = {{"0.4", 1016, 1016}};
  static fkda_transition_args init() { return FKDA_TRANSITION_ARGS_INIT; }
};

template <>
struct AbiStruct<fkda_apply_args> {
  static constexpr const char* name = "fkda_apply_args";
  static constexpr const char* init_macro = "FKDA_APPLY_ARGS_INIT";
  static constexpr StructRelease releases[] = {{"0.4", 456, 456}};
  static fkda_apply_args init() { return FKDA_APPLY_ARGS_INIT; }
};

template <>
struct AbiStruct<fkda_device_info> {
  static constexpr const char* name = "fkda_device_info";
  static constexpr const char* init_macro = "FKDA_DEVICE_INFO_INIT";
  static constexpr StructRelease releases[] = {{"0.1", 296, 292}};
  static fkda_device_info init() { return FKDA_DEVICE_INFO_INIT; }
};

template <>
struct AbiStruct<fkda_build_info> {
  static constexpr const char* name = "fkda_build_info";
  static constexpr const char* init_macro = "FKDA_BUILD_INFO_INIT";
  static constexpr StructRelease releases[] = {{"0.2", 80, 80}};
  static fkda_build_info init() { return FKDA_BUILD_INFO_INIT; }
};

template <>
struct AbiStruct<fkda_launch_report> {
  static constexpr const char* name = "fkda_launch_report";
  static constexpr const char* init_macro = "FKDA_LAUNCH_REPORT_INIT";
  static constexpr StructRelease releases[] = {{"0.2", 32, 32}, {"0.4", 48, 48}};
  static fkda_launch_report init() { return FKDA_LAUNCH_REPORT_INIT; }
};

// The newest row must be this header's struct, or the table is stale.
template <typename Struct>
constexpr bool table_is_current() {
  constexpr auto& rows = AbiStruct<Struct>::releases;
  constexpr size_t n = sizeof rows / sizeof rows[0];
  return rows[n - 1].size == sizeof(Struct) && rows[n - 1].fields_end <= sizeof(Struct);
}
static_assert(table_is_current<fkda_plan_desc>() && table_is_current<fkda_fwd_args>() &&
                  table_is_current<fkda_decode_args>() && table_is_current<fkda_transition_args>() &&
                  table_is_current<fkda_apply_args>() && table_is_current<fkda_device_info>() &&
                  table_is_current<fkda_build_info>() && table_is_current<fkda_launch_report>(),
              "a struct of flashkda.h changed size: add its release to the table in abi_struct.h");

template <typename Struct>
constexpr size_t current_fields_end() {
  constexpr auto& rows = AbiStruct<Struct>::releases;
  return rows[sizeof rows / sizeof rows[0] - 1].fields_end;
}

// How many bytes of fields a caller's struct of `size` bytes holds for this
// library: a release's fields, this library's for a newer caller. Throws,
// naming `argument` and the struct, for a size no release had, one beyond
// kMaxStructGrowth, or (with `given`, an input) a newer struct setting a
// byte this library does not know.
template <typename Struct>
size_t versioned_fields_end(size_t size, const void* given, const char* argument) {
  using Table = AbiStruct<Struct>;
  for (const StructRelease& r : Table::releases)
    if (size == r.size) return r.fields_end;
  const std::string head = std::string(argument) + ": struct_size is " + std::to_string(size) + ", ";
  constexpr size_t known = sizeof(Struct);
  if (size > known && size - known <= kMaxStructGrowth) {
    // From the end of the fields, not of the struct: releases have put new
    // fields in the trailing padding of the one before (0.3's gate_mode,
    // 0.4's vsplit), and a newer caller's field there must not go unseen.
    const auto* bytes = static_cast<const unsigned char*>(given);
    for (size_t i = current_fields_end<Struct>(); bytes != nullptr && i < size; ++i) {
      if (bytes[i] != 0) {
        invalid(head + "larger than this library's " + Table::name + " (" + std::to_string(known) + " bytes), and byte " +
                std::to_string(i) + " is not zero: the caller sets a field this library does not know (it was built "
                "against a newer flashkda.h)");
      }
    }
    return current_fields_end<Struct>();
  }
  std::string sizes;
  for (const StructRelease& r : Table::releases) {
    sizes += std::to_string(r.size) + " in " + r.version + ", ";
  }
  invalid(head + "not a size " + Table::name + " has had (" + sizes + "or larger with zeros past " +
          std::to_string(known) + (size > known ? ", up to " + std::to_string(known + kMaxStructGrowth) : std::string()) +
          "); initialise it with " + Table::init_macro);
}

// The struct the library works with: the caller's fields of its release
// over the _INIT values, struct_size set to this library's size.
template <typename Struct>
Struct read_versioned(const Struct* given, const char* argument) {
  if (given == nullptr) invalid(std::string(argument) + ": NULL");
  const size_t end = versioned_fields_end<Struct>(given->struct_size, given, argument);
  Struct read = AbiStruct<Struct>::init();
  std::memcpy(static_cast<void*>(&read), given, end);
  read.struct_size = sizeof(Struct);
  return read;
}

// Checks an output struct's struct_size (its contents are the caller's and
// are not read) and returns the bytes of fields to write: call it before
// doing anything, then write_versioned.
template <typename Struct>
size_t output_fields_end(const Struct* destination, const char* argument) {
  if (destination == nullptr) invalid(std::string(argument) + ": NULL output pointer");
  return versioned_fields_end<Struct>(destination->struct_size, nullptr, argument);
}

// `value`'s fields that the caller's release has, behind its struct_size;
// nothing past them is written, not even padding.
template <typename Struct>
void write_versioned(Struct* destination, const Struct& value, const char* argument) {
  const size_t end = output_fields_end(destination, argument);
  constexpr size_t first = sizeof(size_t);
  std::memcpy(reinterpret_cast<unsigned char*>(destination) + first,
              reinterpret_cast<const unsigned char*>(&value) + first, end - first);
}

}  // namespace fkda
