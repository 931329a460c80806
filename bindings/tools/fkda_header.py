#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Describes include/flashkda.h as JSON: the one source the bindings' ABI
checkers (Python test_abi, Rust header_abi, Julia check_ccalls.py) compare
their declarations with.

    python3 bindings/tools/fkda_header.py [include/flashkda.h] [--cc COMPILER]

The declarations come from a small parser of exactly what the header uses
(integer #defines, typedef'd enums and structs, typedefs of pointers to
opaque structs, prototypes marked FKDA_API); sizes, field offsets and the
values of the _INIT macros come from a C program compiled against the
header (CC, else cc), so they are the compiler's, not a guess. The output:

    defines    {name: integer}
    enums      {typedef name: {"size": bytes, "constants": {name: value}}}
    typedefs   {name: {"canonical": type, "size": bytes}}   (opaque handles)
    structs    {tag: {"size": bytes,
                      "fields": [{"name", "spelling", "canonical", "offset"}],
                      "init": null or {"macro": name, "values": {field: value}}}}
    functions  {name: {"return": {"spelling", "canonical"},
                       "params": [{"name", "spelling", "canonical"}]}}

Types are reduced to a canonical spelling that other languages' declarations
can be mapped to:

    void char i8 u8 i16 u16 i32 u32 i64 u64 usize f32 f64
    ptr(T)         a pointer to mutable T
    cptr(T)        a pointer to const T (without_const() forgets the difference)
    struct TAG     a struct, by its tag
    array(T,N)     a fixed-size array field

C enums become i32 (their size and passing convention on the supported
targets). In "init" values a pointer is its address (0 for NULL), a nested
struct an object, an array a list, a char array a string.

Python 3 standard library only.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_PRIMITIVES = {
    "void": "void",
    "char": "char",
    "signed char": "i8",
    "unsigned char": "u8",
    "int8_t": "i8",
    "uint8_t": "u8",
    "short": "i16",
    "int16_t": "i16",
    "uint16_t": "u16",
    "int": "i32",
    "unsigned": "u32",
    "unsigned int": "u32",
    "int32_t": "i32",
    "uint32_t": "u32",
    "int64_t": "i64",
    "uint64_t": "u64",
    "long long": "i64",
    "unsigned long long": "u64",
    "size_t": "usize",
    "float": "f32",
    "double": "f64",
}

_SIGNED = {"char", "i8", "i16", "i32", "i64"}
_UNSIGNED = {"u8", "u16", "u32", "u64", "usize"}
_FLOATS = {"f32", "f64"}


def without_const(canonical):
    """The canonical type with const pointees read as mutable ones, for
    languages whose pointers carry no const (ctypes, Julia)."""
    return canonical.replace("cptr(", "ptr(")


class _Declarations:
    """What the parser collects; types are resolved against it."""

    def __init__(self, defines, macros):
        self.defines = defines  # integer #defines
        self.macros = macros  # every #define name
        self.enums = {}  # typedef name -> {constant: value}
        self.struct_typedefs = {}  # typedef name -> tag
        self.pointer_typedefs = {}  # typedef name -> canonical
        self.structs = {}  # tag -> [field dict]
        self.functions = {}  # name -> {"return", "params"}

    def canonical(self, spelling):
        """Canonical form of a C type spelling such as 'const fkda_plan_desc*'."""
        words = spelling.replace("*", " * ").split()
        depth = words.count("*")
        first_star = words.index("*") if depth else len(words)
        const_pointee = "const" in words[:first_star]
        base = " ".join(w for w in words if w not in ("const", "volatile", "struct", "enum", "*"))
        if base in _PRIMITIVES:
            result = _PRIMITIVES[base]
        elif base in self.enums:
            result = "i32"
        elif base in self.struct_typedefs:
            result = f"struct {self.struct_typedefs[base]}"
        elif base in self.pointer_typedefs:
            result = self.pointer_typedefs[base]
        elif re.fullmatch(r"\w+", base) and ("struct" in words or base in self.structs):
            # A struct tag, possibly of an opaque struct (fkda_plan_s, CUstream_st).
            result = f"struct {base}"
        else:
            raise ValueError(f"unknown C type '{spelling}'")
        for level in range(depth):
            result = f"cptr({result})" if level == 0 and const_pointee else f"ptr({result})"
        return result


def _preprocess(text):
    """Drops comments and the blocks a C99 compiler outside C++ and Windows
    would not see; returns the kept text, the integer #defines and the names
    of all #defines."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = text.replace("\\\n", " ")
    defines, macros, kept = {}, set(), []
    # Each open conditional: (this branch active, some branch was taken).
    stack = []

    def active():
        return all(branch for branch, _ in stack)

    def condition_holds(condition):
        return "__cplusplus" not in condition and "_WIN32" not in condition

    for line in text.split("\n"):
        stripped = line.strip()
        if not stripped.startswith("#"):
            if active():
                kept.append(line)
            continue
        directive = stripped[1:].strip()
        keyword = directive.split(None, 1)[0] if directive else ""
        rest = directive[len(keyword):].strip()
        if keyword in ("if", "ifdef", "ifndef"):
            holds = condition_holds(rest)
            stack.append((holds, holds))
        elif keyword == "elif":
            _, taken = stack.pop()
            holds = not taken and condition_holds(rest)
            stack.append((holds, taken or holds))
        elif keyword == "else":
            _, taken = stack.pop()
            stack.append((not taken, True))
        elif keyword == "endif":
            stack.pop()
        elif keyword == "define" and active():
            macros.add(rest.split(None, 1)[0].split("(")[0])
            match = re.match(r"(\w+)\s+(-?(?:0x[0-9a-fA-F]+|\d+))[uUlL]*\s*$", rest)
            if match:
                defines[match.group(1)] = int(match.group(2), 0)
    return "\n".join(kept), defines, macros


def _split_declaration(declaration, decls):
    """'const fkda_plan_desc* desc' -> ('const fkda_plan_desc*', 'desc', None);
    'int64_t shape[FKDA_MAX_RANK]' -> ('int64_t', 'shape', 6)."""
    declaration = " ".join(declaration.split())
    match = re.match(r"^(.*?)(\w+)\s*(\[\s*(\w+)\s*\])?$", declaration)
    if not match:
        raise ValueError(f"cannot parse declaration '{declaration}'")
    type_part, name, _, extent = match.groups()
    if not [w for w in type_part.replace("*", " * ").split() if w not in ("const", "volatile", "*")]:
        return declaration, None, None  # only a type, no name ('int32_t', 'void')
    if extent is not None:
        extent = int(extent) if extent.isdigit() else decls.defines[extent]
    return type_part.strip(), name, extent


def parse(path):
    """The header's declarations, without sizes (those need a compiler)."""
    with open(path, encoding="utf-8") as handle:
        text, defines, macros = _preprocess(handle.read())
    decls = _Declarations(defines, macros)

    for match in re.finditer(r"typedef\s+enum\s+(\w+)?\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        constants, next_value = {}, 0
        for item in (part.strip() for part in match.group(2).split(",")):
            if not item:
                continue
            name, _, value = (part.strip() for part in item.partition("="))
            if value:
                next_value = int(value, 0)
            constants[name] = next_value
            next_value += 1
        decls.enums[match.group(3)] = constants

    for match in re.finditer(r"typedef\s+struct\s+(\w+)\s*\*\s*(\w+)\s*;", text):
        decls.pointer_typedefs[match.group(2)] = f"ptr(struct {match.group(1)})"

    struct_pattern = r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;"
    for match in re.finditer(struct_pattern, text, flags=re.S):
        decls.struct_typedefs[match.group(3)] = match.group(1)
    for match in re.finditer(struct_pattern, text, flags=re.S):
        fields = []
        for declaration in match.group(2).split(";"):
            if not declaration.strip():
                continue
            type_part, name, extent = _split_declaration(declaration, decls)
            canonical, spelling = decls.canonical(type_part), type_part
            if extent is not None:
                canonical, spelling = f"array({canonical},{extent})", f"{type_part}[{extent}]"
            fields.append({"name": name, "spelling": spelling, "canonical": canonical})
        decls.structs[match.group(1)] = fields

    for match in re.finditer(r"FKDA_API\s+([^;(]*?)\b(fkda_\w+)\s*\(([^)]*)\)\s*;", text, flags=re.S):
        return_spelling = " ".join(match.group(1).split())
        params = []
        raw_params = match.group(3).strip()
        if raw_params and raw_params != "void":
            for raw in raw_params.split(","):
                type_part, name, _ = _split_declaration(raw, decls)
                params.append({"name": name, "spelling": type_part,
                               "canonical": decls.canonical(type_part)})
        decls.functions[match.group(2)] = {
            "return": {"spelling": return_spelling, "canonical": decls.canonical(return_spelling)},
            "params": params,
        }
    return decls


def _init_macro(decls, tag):
    """FKDA_PLAN_DESC_INIT for fkda_plan_desc, FKDA_TENSOR_NONE for fkda_tensor."""
    stem = tag.upper()
    for name in (f"{stem}_INIT", f"{stem}_NONE"):
        if name in decls.macros:
            return name
    return None


class _Probe:
    """The C program that measures the header, and where each printed value
    goes in the description."""

    def __init__(self):
        self.lines = []
        self.slots = []  # (container, key, kind) per printed value, in order

    def value(self, container, key, expression, kind):
        formats = {
            "signed": ('%lld', f"(long long)({expression})"),
            "unsigned": ('%llu', f"(unsigned long long)({expression})"),
            "float": ('%.17g', f"(double)({expression})"),
            "pointer": ('%llu', f"(unsigned long long)(uintptr_t)({expression})"),
            "string": ('%s', f"{expression}"),
        }
        fmt, argument = formats[kind]
        container[key] = None  # keeps the header's field order in the output
        self.lines.append(f'  printf("{fmt}\\n", {argument});')
        self.slots.append((container, key, kind))

    def init_values(self, decls, tag, expression, container):
        for field in decls.structs[tag]:
            self.leaf(decls, field["canonical"], f"{expression}.{field['name']}", container,
                      field["name"])

    def leaf(self, decls, canonical, expression, container, key):
        array = re.fullmatch(r"array\((.*),(\d+)\)", canonical)
        if array and array.group(1) == "char":
            self.value(container, key, expression, "string")
        elif array:
            container[key] = [None] * int(array.group(2))
            for index in range(int(array.group(2))):
                self.leaf(decls, array.group(1), f"{expression}[{index}]", container[key], index)
        elif canonical.startswith("struct "):
            container[key] = {}
            self.init_values(decls, canonical[len("struct "):], expression, container[key])
        elif canonical.startswith(("ptr(", "cptr(")):
            self.value(container, key, expression, "pointer")
        elif canonical in _FLOATS:
            self.value(container, key, expression, "float")
        elif canonical in _UNSIGNED:
            self.value(container, key, expression, "unsigned")
        elif canonical in _SIGNED:
            self.value(container, key, expression, "signed")
        else:
            raise ValueError(f"no way to print a {canonical}")

    def run(self, header_path, compiler):
        source = "\n".join(
            ["#include <stdint.h>", "#include <stdio.h>", "#include <stddef.h>",
             '#include "flashkda.h"', "int main(void) {"] + self.lines + ["  return 0;", "}", ""])
        with tempfile.TemporaryDirectory(prefix="fkda_header_") as work:
            program = os.path.join(work, "probe")
            with open(program + ".c", "w", encoding="utf-8") as handle:
                handle.write(source)
            subprocess.run([compiler, "-std=c99", "-I", os.path.dirname(os.path.abspath(header_path)),
                            program + ".c", "-o", program], check=True)
            printed = subprocess.run([program], check=True, capture_output=True,
                                     text=True).stdout.split("\n")
        for (container, key, kind), text in zip(self.slots, printed):
            container[key] = text if kind == "string" else float(text) if kind == "float" else int(text)


def describe(header_path, compiler=None):
    """The description the command line prints, as a dict."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (set CC) to measure the header's layouts with")
    decls = parse(header_path)
    probe = _Probe()
    enums = {}
    for name, constants in decls.enums.items():
        enums[name] = {"constants": constants}
        probe.value(enums[name], "size", f"sizeof({name})", "unsigned")
    typedefs = {}
    for name, canonical in decls.pointer_typedefs.items():
        typedefs[name] = {"canonical": canonical}
        probe.value(typedefs[name], "size", f"sizeof({name})", "unsigned")
    structs = {}
    for tag, fields in decls.structs.items():
        entry = structs[tag] = {"fields": [dict(f) for f in fields], "init": None}
        probe.value(entry, "size", f"sizeof(struct {tag})", "unsigned")
        for field in entry["fields"]:
            probe.value(field, "offset", f"offsetof(struct {tag}, {field['name']})", "unsigned")
        macro = _init_macro(decls, tag)
        if macro:
            entry["init"] = {"macro": macro, "values": {}}
            variable = f"init_{tag}"
            probe.lines.append(f"  struct {tag} {variable} = {macro};")
            probe.init_values(decls, tag, variable, entry["init"]["values"])
    probe.run(header_path, compiler)
    return {"defines": decls.defines, "enums": enums, "typedefs": typedefs, "structs": structs,
            "functions": decls.functions}


def main(argv=None):
    default_header = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                  "include", "flashkda.h")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("header", nargs="?", default=os.path.normpath(default_header))
    parser.add_argument("--cc", help="the C compiler (default: $CC, else cc)")
    args = parser.parse_args(argv)
    json.dump(describe(args.header, args.cc), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
