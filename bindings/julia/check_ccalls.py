#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Checks the Julia package's ccalls against include/flashkda.h.

No Julia is needed: every `@ccall` and `ccall` in the package's .jl files is
parsed, and its function name, argument count and argument and return types
are compared with the header's prototypes. Julia type aliases (`const X = Y`)
and the package's struct mirrors are resolved; the mirrors of the header's
structs are compared field by field, every call of a mirror's constructor
with plain arguments must pass one per field (a field appended to the header
and its mirror but not to such a call fails only at run time in Julia), and
the header's enum constants and integer defines (the version, FKDA_MAX_RANK)
must be defined with the same values. Any exported fkda_* function without a
ccall wrapper is an error. The header's side is the description of
bindings/tools/fkda_header.py (which needs a C compiler: $CC, else cc).

    python3 bindings/julia/check_ccalls.py [--header include/flashkda.h]
                                          [--package bindings/julia/FlashKDA]

Exit status 0 when everything matches, 1 with one line per problem otherwise.
Python 3 standard library only.
"""

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import fkda_header  # noqa: E402

DEFAULT_HEADER = os.path.join(os.path.dirname(os.path.dirname(HERE)), "include", "flashkda.h")
DEFAULT_PACKAGE = os.path.join(HERE, "FlashKDA")

# Julia names of C types on the supported (64-bit Linux) targets.
JULIA_PRIMITIVES = {
    "Cvoid": "void", "Nothing": "void",
    "Cchar": "char", "Cstring": "ptr(char)",
    "Int8": "i8", "UInt8": "u8", "Cuchar": "u8",
    "Int16": "i16", "Cshort": "i16", "UInt16": "u16", "Cushort": "u16",
    "Int32": "i32", "Cint": "i32", "UInt32": "u32", "Cuint": "u32",
    "Int64": "i64", "Clonglong": "i64", "Clong": "i64", "Int": "i64",
    "UInt64": "u64", "Culonglong": "u64", "Culong": "u64",
    "Csize_t": "usize", "UInt": "usize",
    "Float32": "f32", "Cfloat": "f32", "Float64": "f64", "Cdouble": "f64",
}

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_0-9!]*")


# ------------------------------------------------------------------ source


def _string_end(text, i, delimiter):
    """Index of the delimiter closing a string whose contents start at i,
    stepping over escapes and $(...) interpolations (which may hold strings)."""
    n = len(text)
    while i < n:
        if text.startswith(delimiter, i):
            return i
        if text[i] == "\\":
            i += 2
        elif text.startswith("$(", i):
            i = _interpolation_end(text, i + 1)
        else:
            i += 1
    return n


def _interpolation_end(text, i):
    """Index just past the parenthesis closing the one at text[i]."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == '"':
            delimiter = '"""' if text.startswith('"""', i) else '"'
            i = _string_end(text, i + len(delimiter), delimiter) + len(delimiter)
            continue
        i += 1
    return n


def blank_comments_and_strings(text):
    """Comments and string contents become spaces (newlines kept), so that
    offsets and line numbers stay those of the file and nothing inside a
    docstring or comment is mistaken for code."""
    out = list(text)
    i, n = 0, len(text)

    def blank(start, end):
        for j in range(start, min(end, n)):
            if out[j] != "\n":
                out[j] = " "

    previous_code = ""
    while i < n:
        c = text[i]
        if text.startswith("#=", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("#=", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("=#", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif c in "\"`":
            delimiter = c * 3 if text.startswith(c * 3, i) else c
            j = _string_end(text, i + len(delimiter), delimiter)
            blank(i + len(delimiter), j)
            i = j + len(delimiter)
            previous_code = c
        elif c == "'" and not (previous_code.isalnum() or previous_code in "_)]}'.!"):
            # A character literal (otherwise an adjoint).
            j = i + 1
            while j < n and text[j] != "'":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
            previous_code = "'"
        else:
            if not c.isspace():
                previous_code = c
            i += 1
    return "".join(out)


def matching(text, start):
    """Index just past the bracket closing the one at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")}]":
            if not stack or stack.pop() != c:
                raise ValueError(f"unbalanced '{c}'")
            if not stack:
                return i + 1
    raise ValueError("unbalanced brackets")


def split_top_level(text, separator=","):
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def split_type_annotation(argument):
    """'desc::Ref{fkda_plan_desc}' -> ('desc', 'Ref{fkda_plan_desc}')."""
    depth = 0
    for i in range(len(argument) - 1, 0, -1):
        c = argument[i]
        if c in ")}]":
            depth += 1
        elif c in "({[":
            depth -= 1
        elif depth == 0 and argument[i - 1:i + 1] == "::":
            return argument[:i - 1].strip(), argument[i + 1:].strip()
    return argument.strip(), None


@dataclass
class CcallSite:
    file: str
    line: int
    name: Optional[str]
    target: str
    argument_names: List[str]
    argument_types: List[Optional[str]]
    return_type: Optional[str]

    def where(self):
        return f"{self.file}:{self.line}"


def read_type(text, start):
    """A Julia type expression at text[start:] (Name, Mod.Name, Name{...})."""
    match = re.compile(r"\s*([A-Za-z_][\w.]*)").match(text, start)
    if not match:
        return None, start
    end = match.end()
    if end < len(text) and text[end] == "{":
        end = matching(text, end)
    return text[match.start(1):end], end


def function_name(target):
    symbol = re.search(r":(fkda_\w+)|\"(fkda_\w+)\"", target)
    if symbol:
        return symbol.group(1) or symbol.group(2)
    bare = re.fullmatch(r"\s*(?:[\w.]*\.)?(\w+)\s*", target)
    return bare.group(1) if bare else None


def find_ccalls(path, relative):
    with open(path, encoding="utf-8") as handle:
        original = handle.read()
    code = blank_comments_and_strings(original)
    sites = []

    def line_of(offset):
        return code.count("\n", 0, offset) + 1

    for match in re.finditer(r"@ccall\b", code):
        position = match.end()
        while code[position].isspace():
            position += 1
        if code[position] == "$":
            position += 1
            if code[position] == "(":
                end = matching(code, position)
            else:
                end = IDENTIFIER.match(code, position).end()
            target = code[position:end]
            # Symbols such as :fkda_fwd are code, so they survived blanking.
        else:
            end = re.compile(r"[\w.]+").match(code, position).end()
            target = code[position:end]
        if code[end] != "(":
            raise ValueError(f"{relative}:{line_of(match.start())}: cannot parse this @ccall")
        arguments_end = matching(code, end)
        arguments = split_top_level(code[end + 1:arguments_end - 1])
        names, types = zip(*(split_type_annotation(a) for a in arguments)) if arguments else ((), ())
        return_type = None
        rest = code[arguments_end:]
        annotation = re.match(r"\s*::", rest)
        if annotation:
            return_type, _ = read_type(code, arguments_end + annotation.end())
        sites.append(CcallSite(relative, line_of(match.start()), function_name(target), target,
                               list(names), list(types), return_type))

    for match in re.finditer(r"(?<![\w@.])ccall\s*\(", code):
        open_paren = match.end() - 1
        close = matching(code, open_paren)
        parts = split_top_level(code[open_paren + 1:close - 1])
        if len(parts) < 3:
            raise ValueError(f"{relative}:{line_of(match.start())}: cannot parse this ccall")
        target, return_type, argument_tuple = parts[0], parts[1], parts[2]
        if argument_tuple.startswith("(") and argument_tuple.endswith(")"):
            types = split_top_level(argument_tuple[1:-1])
        else:
            types = [argument_tuple]
        values = parts[3:]
        sites.append(CcallSite(relative, line_of(match.start()), function_name(target), target,
                               [v if i < len(values) else f"#{i + 1}" for i, v in enumerate(values)]
                               + [f"#{i + 1}" for i in range(len(values), len(types))],
                               types, return_type))
    return sites, code


# ------------------------------------------------------------------- types


class JuliaTypes:
    """Aliases, struct mirrors and constants collected from the package."""

    def __init__(self):
        self.aliases = {}  # name -> (right-hand side, where)
        self.structs = {}  # name -> list of (field, type, where)
        self.constants = {}  # name -> (value text, where)

    def collect(self, code, relative):
        def line_of(offset):
            return code.count("\n", 0, offset) + 1

        for match in re.finditer(r"^[ \t]*const[ \t]+(\w+)[ \t]*=[ \t]*(.+?)[ \t]*$", code, re.M):
            where = f"{relative}:{line_of(match.start())}"
            self.aliases[match.group(1)] = (match.group(2), where)
            self.constants[match.group(1)] = (match.group(2), where)
        for match in re.finditer(r"^[ \t]*(?:mutable[ \t]+)?struct[ \t]+(\w+)([^\n]*)$", code, re.M):
            name, rest = match.group(1), match.group(2)
            fields = []
            if re.search(r"\bend\s*$", rest):
                self.structs[name] = fields  # `struct X end`: opaque
                continue
            offset = match.end()
            for line in code[offset:].split("\n")[1:]:
                stripped = line.strip()
                if stripped == "end":
                    break
                field = re.fullmatch(r"(\w+)\s*::\s*(.+)", stripped)
                if field:
                    fields.append((field.group(1), field.group(2).strip(),
                                   f"{relative}:{line_of(offset)}"))
                elif stripped:
                    # Constructors and the like: not a plain C mirror.
                    fields = None
                    break
            if fields is not None:
                self.structs[name] = fields

    def canonical(self, spelling, seen=()):
        spelling = spelling.strip()
        if spelling in seen:
            raise ValueError(f"alias cycle through {spelling}")
        generic = re.fullmatch(r"([\w.]+)\s*\{(.*)\}", spelling, re.S)
        if generic:
            head = generic.group(1).split(".")[-1]
            parameters = split_top_level(generic.group(2))
            if head in ("Ptr", "Ref") and len(parameters) == 1:
                return f"ptr({self.canonical(parameters[0], seen)})"
            if head == "NTuple" and len(parameters) == 2:
                count = parameters[0]
                if not count.isdigit():
                    count = self.aliases.get(count, (count, None))[0]
                return f"array({self.canonical(parameters[1], seen)},{count})"
            raise ValueError(f"unsupported type {spelling}")
        name = spelling.split(".")[-1]
        if name in JULIA_PRIMITIVES:
            return JULIA_PRIMITIVES[name]
        if name in self.structs:
            return f"struct {name}"
        if name in self.aliases:
            return self.canonical(self.aliases[name][0], seen + (spelling,))
        raise ValueError(f"unknown type {spelling}")


def describe(julia_types, spelling):
    try:
        return julia_types.canonical(spelling)
    except ValueError as error:
        return f"<{error}>"


@dataclass
class ConstructorCall:
    where: str
    name: str
    arguments: List[str]


def constructor_calls(codes, struct_names):
    """Calls `S(a, b, ...)` of the header's struct mirrors with plain
    positional arguments. Calls that splat (`xs...`) or pass keywords cannot
    be counted and are left out, as are definitions (`function S(`, `S(...) =`)."""
    calls = []
    pattern = re.compile(r"(?<![\w:])(" + "|".join(map(re.escape, struct_names)) + r")\s*\(")
    for relative, code in codes:
        for match in pattern.finditer(code):
            line_start = code.rfind("\n", 0, match.start()) + 1
            if re.match(r"\s*(function|struct|mutable\s+struct)\b", code[line_start:match.start()]):
                continue
            open_paren = match.end() - 1
            close = matching(code, open_paren)
            inside = code[open_paren + 1:close - 1]
            if re.match(r"\s*=(?!=)", code[close:]):
                continue  # a method definition
            arguments = split_top_level(inside)
            if any(a.endswith("...") for a in arguments) or ";" in inside:
                continue
            line = code.count("\n", 0, match.start()) + 1
            calls.append(ConstructorCall(f"{relative}:{line}", match.group(1), arguments))
    return calls


# ------------------------------------------------------------------- check


def check(header_path, package_dir):
    header = fkda_header.describe(header_path)
    julia_files = []
    for directory, _, files in os.walk(package_dir):
        for name in sorted(files):
            if name.endswith(".jl"):
                julia_files.append(os.path.join(directory, name))
    julia_files.sort()
    problems = []
    sites = []
    codes = []  # (relative path, code with comments and strings blanked)
    julia_types = JuliaTypes()
    for path in julia_files:
        relative = os.path.relpath(path, os.path.dirname(package_dir))
        try:
            found, code = find_ccalls(path, relative)
        except ValueError as error:
            problems.append(str(error))
            continue
        sites.extend(found)
        codes.append((relative, code))
        julia_types.collect(code, relative)

    covered = set()
    for site in sites:
        if site.name is None:
            problems.append(f"{site.where()}: cannot tell which function `{site.target}` calls")
            continue
        if not site.name.startswith("fkda_"):
            continue  # not a libflashkda function
        function = header["functions"].get(site.name)
        if function is None:
            problems.append(f"{site.where()}: {site.name} is not a function of the header")
            continue
        covered.add(site.name)
        if len(site.argument_types) != len(function["params"]):
            problems.append(
                f"{site.where()}: {site.name}: {len(site.argument_types)} arguments in the ccall, "
                f"{len(function['params'])} in the header")
            continue
        for index, (julia_type, name, param) in enumerate(
                zip(site.argument_types, site.argument_names, function["params"]), start=1):
            if julia_type is None:
                problems.append(f"{site.where()}: {site.name}: argument {index} ({name}) has no type")
                continue
            canonical = describe(julia_types, julia_type)
            c_type = fkda_header.without_const(param["canonical"])
            if canonical != c_type:
                problems.append(
                    f"{site.where()}: {site.name}: argument {index} ({param['name']}) is {julia_type} "
                    f"({canonical}), the header has {param['spelling']} ({c_type})")
        if site.return_type is None:
            problems.append(f"{site.where()}: {site.name}: the ccall declares no return type")
        else:
            canonical = describe(julia_types, site.return_type)
            c_type = fkda_header.without_const(function["return"]["canonical"])
            if canonical != c_type:
                problems.append(
                    f"{site.where()}: {site.name}: returns {site.return_type} ({canonical}), "
                    f"the header has {function['return']['spelling']} ({c_type})")

    for name in header["functions"]:
        if name not in covered:
            problems.append(f"{name}: exported by the header but the package has no ccall wrapper for it")

    for tag, layout in header["structs"].items():
        c_fields = layout["fields"]
        julia_fields = julia_types.structs.get(tag)
        if julia_fields is None:
            problems.append(f"struct {tag}: the package has no plain-field mirror of it")
            continue
        where = julia_fields[0][2] if julia_fields else "?"
        julia_names = [field for field, _, _ in julia_fields]
        c_names = [f["name"] for f in c_fields]
        if julia_names != c_names:
            problems.append(f"{where}: struct {tag}: fields {julia_names}, the header has {c_names}")
            continue
        for (field, spelling, _), c_field in zip(julia_fields, c_fields):
            canonical = describe(julia_types, spelling)
            c_type = fkda_header.without_const(c_field["canonical"])
            if canonical != c_type:
                problems.append(
                    f"{where}: struct {tag}: field {field} is {spelling} ({canonical}), "
                    f"the header has {c_field['spelling']} ({c_type})")

    # Enum constants may be wrapped in their alias (`fkda_status(4)`), defines not.
    expected = [(constant, value, "enum constant", r"(?:\w+\()?\s*(-?\d+)\s*\)?")
                for enum in header["enums"].values() for constant, value in enum["constants"].items()]
    expected += [(name, value, "define", r"\s*(-?\d+)\s*") for name, value in header["defines"].items()]
    for constant, value, kind, spelling in expected:
        if constant not in julia_types.constants:
            problems.append(f"{constant}: {kind} of the header, not defined in the package")
            continue
        text, where = julia_types.constants[constant]
        number = re.fullmatch(spelling, text)
        if not number or int(number.group(1)) != value:
            problems.append(f"{where}: {constant} = {text}, the header has {value}")

    for call in constructor_calls(codes, header["structs"]):
        expected = len(header["structs"][call.name]["fields"])
        if len(call.arguments) != expected:
            problems.append(f"{call.where}: {call.name}(...) passes {len(call.arguments)} "
                            f"arguments, the struct has {expected} fields")

    summary = (f"{len(sites)} ccalls in {len(julia_files)} files; {len(covered)} of "
               f"{len(header['functions'])} header functions wrapped; {len(header['structs'])} structs")
    return problems, summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--header", default=DEFAULT_HEADER, help="path to flashkda.h")
    parser.add_argument("--package", default=DEFAULT_PACKAGE, help="the Julia package directory")
    args = parser.parse_args(argv)
    problems, summary = check(args.header, args.package)
    for problem in problems:
        print(f"check_ccalls: {problem}")
    if problems:
        print(f"check_ccalls: FAILED, {len(problems)} problem(s); {summary}")
        return 1
    print(f"check_ccalls: OK, {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
