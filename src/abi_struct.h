// Reading a versioned ABI struct: the caller's struct_size says which header
// it was built against. Every size from the struct's first published one up
// to the current one is accepted; fields past the caller's size take their
// _INIT values, so an older program keeps its old behaviour.
#pragma once

#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <string>

#include "error.h"

namespace fkda {

// `given` copied over `defaults` up to its struct_size. `first_fields_end`
// is where the fields of the struct's first release end, `later_fields_ends`
// where those of each later release end (oldest first). A release's sizeof
// rounds its end up to the struct's alignment, and the next release's first
// field may sit in that trailing padding (garbage in an older caller's
// struct), so a size up to a release's sizeof reads only that release's
// fields. `name` is the argument's name and `init_macro` the _INIT macro the
// message points to.
template <typename Struct>
Struct read_versioned(const Struct& given, Struct defaults, size_t first_fields_end, const char* name,
                      const char* init_macro, std::initializer_list<size_t> later_fields_ends = {}) {
  const size_t size = given.struct_size;
  if (size < first_fields_end || size > sizeof(Struct)) {
    const std::string accepted = first_fields_end == sizeof(Struct)
                                     ? std::to_string(first_fields_end)
                                     : std::to_string(first_fields_end) + " to " + std::to_string(sizeof(Struct));
    invalid(std::string(name) + ": struct_size is " + std::to_string(size) + ", expected " + accepted +
            " (initialise with " + init_macro +
            (size > sizeof(Struct) ? "; a larger size means the caller was built against a newer flashkda.h)"
                                   : ")"));
  }
  // The newest release whose fields all lie within `size`.
  size_t release_end = first_fields_end;
  for (size_t end : later_fields_ends)
    if (end <= size) release_end = end;
  const size_t release_sizeof = (release_end + alignof(Struct) - 1) / alignof(Struct) * alignof(Struct);
  std::memcpy(static_cast<void*>(&defaults), &given, size <= release_sizeof ? release_end : size);
  defaults.struct_size = sizeof(Struct);
  return defaults;
}

}  // namespace fkda
