// Reading a versioned ABI struct: the caller's struct_size says which header
// it was built against. Every size from the struct's first published one up
// to the current one is accepted; fields past the caller's size take their
// _INIT values, so an older program keeps its old behaviour.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>

#include "error.h"

namespace fkda {

// `given` copied over `defaults` up to its struct_size. `first_fields_end`
// is where the fields of the struct's first release end; that release's
// sizeof rounds it up to the struct's alignment, and a new field may sit in
// that trailing padding (garbage in an old caller's struct), so a size up to
// the first sizeof reads only the first fields. `name` is the argument's name
// and `init_macro` the _INIT macro the message points to.
template <typename Struct>
Struct read_versioned(const Struct& given, Struct defaults, size_t first_fields_end, const char* name,
                      const char* init_macro) {
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
  const size_t first_sizeof = (first_fields_end + alignof(Struct) - 1) / alignof(Struct) * alignof(Struct);
  std::memcpy(static_cast<void*>(&defaults), &given, size <= first_sizeof ? first_fields_end : size);
  defaults.struct_size = sizeof(Struct);
  return defaults;
}

}  // namespace fkda
