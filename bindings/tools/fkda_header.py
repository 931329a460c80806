"""A small parser of include/flashkda.h for the bindings' ABI checks.

It understands exactly what the header uses: integer #defines, typedef'd
enums and structs, typedefs of pointers to opaque structs, and function
prototypes marked FKDA_API. Types are reduced to a canonical spelling so that
other languages' declarations can be compared with them:

    void char i8 u8 i16 u16 i32 u32 i64 u64 usize f32 f64
    ptr(T)              any pointer (const is ignored)
    struct NAME         a struct, by its tag
    array(T,N)          a fixed-size array field

C enums become i32 (their size and passing convention on the supported
targets); the enum's name is kept in `spelling` for messages.

Python 3 standard library only.
"""

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

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


@dataclass
class Param:
    name: Optional[str]
    spelling: str
    canonical: str


@dataclass
class Function:
    name: str
    return_spelling: str
    return_canonical: str
    params: List[Param]


@dataclass
class Field:
    name: str
    spelling: str
    canonical: str


@dataclass
class Header:
    defines: Dict[str, int] = field(default_factory=dict)
    enums: Dict[str, Dict[str, int]] = field(default_factory=dict)  # typedef name -> constants
    structs: Dict[str, List[Field]] = field(default_factory=dict)  # struct tag -> fields
    struct_typedefs: Dict[str, str] = field(default_factory=dict)  # typedef name -> tag
    pointer_typedefs: Dict[str, str] = field(default_factory=dict)  # typedef name -> canonical
    functions: Dict[str, Function] = field(default_factory=dict)

    def canonical(self, spelling):
        """Canonical form of a C type spelling such as 'const fkda_plan_desc*'."""
        text = spelling.replace("*", " * ")
        words = [w for w in text.split() if w not in ("const", "volatile", "struct", "enum")]
        depth = words.count("*")
        base_words = [w for w in words if w != "*"]
        base = " ".join(base_words)
        if base in _PRIMITIVES:
            result = _PRIMITIVES[base]
        elif base in self.enums:
            result = "i32"
        elif base in self.struct_typedefs:
            result = f"struct {self.struct_typedefs[base]}"
        elif base in self.pointer_typedefs:
            result = self.pointer_typedefs[base]
        elif base in self.structs or re.fullmatch(r"\w+", base or ""):
            # A struct tag, possibly of an opaque struct (fkda_plan_s, CUstream_st).
            if "struct" in spelling.split() or base in self.structs:
                result = f"struct {base}"
            else:
                raise ValueError(f"unknown C type '{spelling}'")
        else:
            raise ValueError(f"unknown C type '{spelling}'")
        for _ in range(depth):
            result = f"ptr({result})"
        return result


def _preprocess(text):
    """Drops comments, keeps integer #defines, and removes C++-only blocks."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = text.replace("\\\n", " ")
    defines = {}
    kept = []
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
            match = re.match(r"(\w+)\s+(-?(?:0x[0-9a-fA-F]+|\d+))[uUlL]*\s*$", rest)
            if match:
                defines[match.group(1)] = int(match.group(2), 0)
    return "\n".join(kept), defines


def _split_declaration(declaration, header):
    """'const fkda_plan_desc* desc' -> ('const fkda_plan_desc*', 'desc')."""
    declaration = declaration.strip()
    match = re.match(r"^(.*?)(\w+)\s*(\[\s*(\w+)\s*\])?$", declaration, flags=re.S)
    if not match:
        raise ValueError(f"cannot parse declaration '{declaration}'")
    type_part, name, _, extent = match.groups()
    type_words = type_part.replace("*", " * ").split()
    if not [w for w in type_words if w not in ("const", "volatile", "*")]:
        # Only a type, no name ('int32_t', 'void').
        return declaration, None, None
    if extent is not None:
        extent = int(extent) if extent.isdigit() else header.defines[extent]
    return type_part.strip(), name, extent


def parse_header(path):
    with open(path, encoding="utf-8") as handle:
        text, defines = _preprocess(handle.read())
    header = Header(defines=defines)

    for match in re.finditer(r"typedef\s+enum\s+(\w+)?\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        constants = {}
        next_value = 0
        for item in match.group(2).split(","):
            item = item.strip()
            if not item:
                continue
            if "=" in item:
                name, value = (part.strip() for part in item.split("=", 1))
                next_value = int(value, 0)
            else:
                name = item
            constants[name] = next_value
            next_value += 1
        header.enums[match.group(3)] = constants

    for match in re.finditer(r"typedef\s+struct\s+(\w+)\s*\*\s*(\w+)\s*;", text):
        header.pointer_typedefs[match.group(2)] = f"ptr(struct {match.group(1)})"

    struct_pattern = r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;"
    for match in re.finditer(struct_pattern, text, flags=re.S):
        header.struct_typedefs[match.group(3)] = match.group(1)
    for match in re.finditer(struct_pattern, text, flags=re.S):
        fields = []
        for declaration in match.group(2).split(";"):
            if not declaration.strip():
                continue
            type_part, name, extent = _split_declaration(declaration, header)
            canonical = header.canonical(type_part)
            spelling = type_part
            if extent is not None:
                canonical = f"array({canonical},{extent})"
                spelling = f"{type_part}[{extent}]"
            fields.append(Field(name, spelling, canonical))
        header.structs[match.group(1)] = fields

    for match in re.finditer(r"FKDA_API\s+([^;(]*?)\b(fkda_\w+)\s*\(([^)]*)\)\s*;", text, flags=re.S):
        return_spelling = " ".join(match.group(1).split())
        params = []
        raw_params = match.group(3).strip()
        if raw_params and raw_params != "void":
            for raw in raw_params.split(","):
                type_part, name, _ = _split_declaration(raw, header)
                type_part = " ".join(type_part.split())
                params.append(Param(name, type_part, header.canonical(type_part)))
        header.functions[match.group(2)] = Function(
            match.group(2), return_spelling, header.canonical(return_spelling), params
        )
    return header


if __name__ == "__main__":
    import sys

    parsed = parse_header(sys.argv[1])
    for function in parsed.functions.values():
        args = ", ".join(f"{p.canonical} {p.name}" for p in function.params)
        print(f"{function.return_canonical} {function.name}({args})")
    for tag, fields in parsed.structs.items():
        print(tag, [(f.name, f.canonical) for f in fields])
    print(parsed.enums)
    print(parsed.defines)
