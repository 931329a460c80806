//! flashkda-sys against include/flashkda.h.
//!
//! The header and this crate's src/lib.rs are both parsed (a small parser of
//! exactly the constructs they use), and every function, struct field, enum
//! constant and define is compared after reducing types to a canonical form:
//! `i32`, `usize`, `char`, `void`, `ptr(T)` (mutable pointee), `cptr(T)`
//! (const pointee), `struct TAG`, `array(T,N)`. Struct sizes, field offsets
//! and the _INIT macros are compared with what a C compiler reports.
//!
//! FLASHKDA_INCLUDE_DIR overrides where the header is read from; CC the C
//! compiler (default `cc`).

use flashkda_sys::*;
use std::collections::{BTreeMap, HashMap};
use std::mem::{size_of, MaybeUninit};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::addr_of;

// ------------------------------------------------------------------ tokens

fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'/' && i + 1 < bytes.len() && bytes[i + 1] == b'*' {
            let end = text[i + 2..].find("*/").map(|p| i + 2 + p + 2).unwrap_or(bytes.len());
            // Keep line structure for the preprocessor.
            out.extend(text[i..end].chars().filter(|&c| c == '\n'));
            out.push(' ');
            i = end;
        } else if bytes[i] == b'/' && i + 1 < bytes.len() && bytes[i + 1] == b'/' {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if bytes[i] == b'"' {
            let end = text[i + 1..].find('"').map(|p| i + 1 + p + 1).unwrap_or(bytes.len());
            out.push_str(&text[i..end]);
            i = end;
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn tokenize(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' || c == '.' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == '.') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect());
        } else if c == '"' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += 1;
            }
            i += 1;
            tokens.push(chars[start..i.min(chars.len())].iter().collect());
        } else if (c == '-' && chars.get(i + 1) == Some(&'>')) || (c == ':' && chars.get(i + 1) == Some(&':')) {
            tokens.push(chars[i..i + 2].iter().collect());
            i += 2;
        } else {
            tokens.push(c.to_string());
            i += 1;
        }
    }
    tokens
}

fn parse_integer(text: &str) -> Option<i64> {
    let text = text.trim_end_matches(|c| c == 'u' || c == 'U' || c == 'l' || c == 'L');
    if let Some(hex) = text.strip_prefix("0x") {
        i64::from_str_radix(hex, 16).ok()
    } else {
        text.replace('_', "").parse().ok()
    }
}

fn wrap_pointers(mut canonical: String, depth: usize, const_pointee: bool) -> String {
    for level in 0..depth {
        canonical = if level == 0 && const_pointee {
            format!("cptr({canonical})")
        } else {
            format!("ptr({canonical})")
        };
    }
    canonical
}

// ------------------------------------------------------------------ header

#[derive(Default)]
struct CHeader {
    defines: HashMap<String, i64>,
    enums: BTreeMap<String, Vec<(String, i64)>>,
    struct_typedefs: HashMap<String, String>,
    pointer_typedefs: HashMap<String, String>,
    structs: BTreeMap<String, Vec<(String, String)>>,
    functions: BTreeMap<String, (String, Vec<(String, String)>)>,
}

/// Keeps the declarations a C99 compiler outside C++ and Windows would see,
/// and collects integer #defines.
fn preprocess(text: &str) -> (String, HashMap<String, i64>) {
    let text = strip_comments(text).replace("\\\n", " ");
    let mut defines = HashMap::new();
    let mut kept = String::new();
    let mut stack: Vec<(bool, bool)> = Vec::new(); // (branch active, some branch taken)
    let holds = |condition: &str| !condition.contains("__cplusplus") && !condition.contains("_WIN32");
    for line in text.lines() {
        let trimmed = line.trim();
        let Some(directive) = trimmed.strip_prefix('#') else {
            if stack.iter().all(|&(active, _)| active) {
                kept.push_str(line);
                kept.push('\n');
            }
            continue;
        };
        let directive = directive.trim();
        let (keyword, rest) = directive.split_once(char::is_whitespace).unwrap_or((directive, ""));
        match keyword {
            "if" | "ifdef" | "ifndef" => {
                let h = holds(rest);
                stack.push((h, h));
            }
            "elif" => {
                let (_, taken) = stack.pop().expect("#elif without #if");
                let h = !taken && holds(rest);
                stack.push((h, taken || h));
            }
            "else" => {
                let (_, taken) = stack.pop().expect("#else without #if");
                stack.push((!taken, true));
            }
            "endif" => {
                stack.pop().expect("#endif without #if");
            }
            "define" if stack.iter().all(|&(active, _)| active) => {
                let mut parts = rest.split_whitespace();
                if let (Some(name), Some(value), None) = (parts.next(), parts.next(), parts.next()) {
                    if let Some(number) = parse_integer(value) {
                        defines.insert(name.to_string(), number);
                    }
                }
            }
            _ => {}
        }
    }
    (kept, defines)
}

impl CHeader {
    fn parse(path: &Path) -> CHeader {
        let source = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let (text, defines) = preprocess(&source);
        let tokens = tokenize(&text);
        let mut header = CHeader { defines, ..CHeader::default() };
        // Struct typedef names first: fields and prototypes refer to them.
        for i in 0..tokens.len() {
            if tokens[i] == "typedef" && tokens.get(i + 1).map(String::as_str) == Some("struct") {
                let tag = tokens[i + 2].clone();
                if tokens[i + 3] == "*" {
                    header.pointer_typedefs.insert(tokens[i + 4].clone(), tag);
                } else if tokens[i + 3] == "{" {
                    let close = find_closing(&tokens, i + 3);
                    header.struct_typedefs.insert(tokens[close + 1].clone(), tag);
                }
            }
            if tokens[i] == "typedef" && tokens.get(i + 1).map(String::as_str) == Some("enum") {
                let open = (i..).find(|&j| tokens[j] == "{").unwrap();
                let close = find_closing(&tokens, open);
                let mut constants = Vec::new();
                let mut next_value = 0;
                for item in tokens[open + 1..close].split(|t| t == ",") {
                    if item.is_empty() {
                        continue;
                    }
                    let value = if item.len() >= 3 && item[1] == "=" {
                        let joined: String = item[2..].concat();
                        parse_integer(&joined).expect("enum value")
                    } else {
                        next_value
                    };
                    constants.push((item[0].clone(), value));
                    next_value = value + 1;
                }
                header.enums.insert(tokens[close + 1].clone(), constants);
            }
        }
        let mut i = 0;
        while i < tokens.len() {
            if tokens[i] == "typedef" && tokens[i + 1] == "struct" && tokens[i + 3] == "{" {
                let tag = tokens[i + 2].clone();
                let close = find_closing(&tokens, i + 3);
                let mut fields = Vec::new();
                for declaration in tokens[i + 4..close].split(|t| t == ";") {
                    if declaration.is_empty() {
                        continue;
                    }
                    let (type_tokens, name, extent) = split_declaration(declaration, &header.defines);
                    let mut canonical = header.canonical(type_tokens);
                    if let Some(extent) = extent {
                        canonical = format!("array({canonical},{extent})");
                    }
                    fields.push((name.expect("field name"), canonical));
                }
                header.structs.insert(tag, fields);
                i = close;
            } else if tokens[i] == "FKDA_API" {
                let open = (i..).find(|&j| tokens[j] == "(").unwrap();
                let close = find_closing(&tokens, open);
                let name = tokens[open - 1].clone();
                let return_canonical = header.canonical(&tokens[i + 1..open - 1]);
                let mut params = Vec::new();
                let inner = &tokens[open + 1..close];
                if !(inner.is_empty() || inner == ["void"]) {
                    for param in inner.split(|t| t == ",") {
                        let (type_tokens, param_name, _) = split_declaration(param, &header.defines);
                        params.push((param_name.unwrap_or_default(), header.canonical(type_tokens)));
                    }
                }
                header.functions.insert(name, (return_canonical, params));
                i = close;
            }
            i += 1;
        }
        header
    }

    fn canonical(&self, tokens: &[String]) -> String {
        let first_star = tokens.iter().position(|t| t == "*");
        let const_pointee = tokens
            .iter()
            .position(|t| t == "const")
            .is_some_and(|c| first_star.is_some_and(|s| c < s));
        let depth = tokens.iter().filter(|t| *t == "*").count();
        let base: Vec<&str> = tokens
            .iter()
            .map(String::as_str)
            .filter(|t| !matches!(*t, "const" | "struct" | "enum" | "*"))
            .collect();
        let base = base.join(" ");
        let resolved = match base.as_str() {
            "void" => "void".to_string(),
            "char" => "char".to_string(),
            "int" | "int32_t" => "i32".to_string(),
            "unsigned" | "unsigned int" | "uint32_t" => "u32".to_string(),
            "int64_t" => "i64".to_string(),
            "uint64_t" => "u64".to_string(),
            "int16_t" => "i16".to_string(),
            "uint16_t" => "u16".to_string(),
            "int8_t" => "i8".to_string(),
            "uint8_t" => "u8".to_string(),
            "size_t" => "usize".to_string(),
            "float" => "f32".to_string(),
            "double" => "f64".to_string(),
            other if self.enums.contains_key(other) => "i32".to_string(),
            other if self.struct_typedefs.contains_key(other) => {
                format!("struct {}", self.struct_typedefs[other])
            }
            other if self.pointer_typedefs.contains_key(other) => {
                format!("ptr(struct {})", self.pointer_typedefs[other])
            }
            other if tokens.iter().any(|t| t == "struct") => format!("struct {other}"),
            other => panic!("unknown C type '{other}' in {tokens:?}"),
        };
        wrap_pointers(resolved, depth, const_pointee)
    }
}

fn find_closing(tokens: &[String], open: usize) -> usize {
    let (opening, closing) = match tokens[open].as_str() {
        "{" => ("{", "}"),
        "(" => ("(", ")"),
        "[" => ("[", "]"),
        "<" => ("<", ">"),
        other => panic!("not an opening token: {other}"),
    };
    let mut depth = 0;
    for (j, token) in tokens.iter().enumerate().skip(open) {
        if token == opening {
            depth += 1;
        } else if token == closing {
            depth -= 1;
            if depth == 0 {
                return j;
            }
        }
    }
    panic!("unbalanced {opening}");
}

/// `const fkda_plan_desc * desc` -> (type tokens, Some("desc"), None);
/// `int64_t shape [ FKDA_MAX_RANK ]` -> (.., Some("shape"), Some(6)).
fn split_declaration<'a>(
    tokens: &'a [String],
    defines: &HashMap<String, i64>,
) -> (&'a [String], Option<String>, Option<i64>) {
    let mut tokens = tokens;
    let mut extent = None;
    if tokens.last().map(String::as_str) == Some("]") {
        let open = tokens.iter().position(|t| t == "[").unwrap();
        let size = &tokens[open + 1];
        extent = Some(parse_integer(size).unwrap_or_else(|| defines[size.as_str()]));
        tokens = &tokens[..open];
    }
    let type_words = tokens.iter().filter(|t| !matches!(t.as_str(), "const" | "*")).count();
    if type_words >= 2 {
        let (name, type_tokens) = tokens.split_last().unwrap();
        (type_tokens, Some(name.clone()), extent)
    } else {
        (tokens, None, extent)
    }
}

// --------------------------------------------------------------- rust side

#[derive(Default)]
struct RustDecls {
    aliases: HashMap<String, Vec<String>>,
    consts: HashMap<String, Vec<String>>,
    structs: BTreeMap<String, Vec<(String, Vec<String>)>>,
    functions: BTreeMap<String, (Vec<String>, Vec<(String, Vec<String>)>)>,
}

/// Splits `tokens` at top-level commas (outside (), [], <>).
fn split_top_level(tokens: &[String]) -> Vec<&[String]> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (j, token) in tokens.iter().enumerate() {
        match token.as_str() {
            "(" | "[" | "<" => depth += 1,
            ")" | "]" | ">" => depth -= 1,
            "," if depth == 0 => {
                parts.push(&tokens[start..j]);
                start = j + 1;
            }
            _ => {}
        }
    }
    if start < tokens.len() {
        parts.push(&tokens[start..]);
    }
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

impl RustDecls {
    fn parse(source: &str) -> RustDecls {
        let tokens = tokenize(&strip_comments(source));
        let mut decls = RustDecls::default();
        let mut i = 0;
        while i < tokens.len() {
            if tokens[i] == "#" {
                // An attribute: #[...] or #![...].
                let open = (i..).find(|&j| tokens[j] == "[").unwrap();
                i = find_closing(&tokens, open) + 1;
                continue;
            }
            if tokens[i] != "pub" {
                i += 1;
                continue;
            }
            let kind = tokens[i + 1].as_str();
            let name = tokens[i + 2].clone();
            let end = (i..).find(|&j| tokens[j] == ";" || tokens[j] == "{").unwrap();
            match kind {
                "type" => {
                    decls.aliases.insert(name, tokens[i + 4..end].to_vec());
                    i = end + 1;
                }
                "const" => {
                    let equals = (i..).find(|&j| tokens[j] == "=").unwrap();
                    let semicolon = (equals..).find(|&j| tokens[j] == ";").unwrap();
                    decls.consts.insert(name, tokens[equals + 1..semicolon].to_vec());
                    i = semicolon + 1;
                }
                "struct" => {
                    let close = find_closing(&tokens, i + 3);
                    let mut fields = Vec::new();
                    for field in split_top_level(&tokens[i + 4..close]) {
                        let field = if field[0] == "pub" { &field[1..] } else { field };
                        fields.push((field[0].clone(), field[2..].to_vec()));
                    }
                    decls.structs.insert(name, fields);
                    i = close + 1;
                }
                "fn" => {
                    let open = i + 3;
                    let close = find_closing(&tokens, open);
                    let semicolon = (close..).find(|&j| tokens[j] == ";").unwrap();
                    let return_tokens = if tokens[close + 1] == "->" {
                        tokens[close + 2..semicolon].to_vec()
                    } else {
                        Vec::new()
                    };
                    let params = split_top_level(&tokens[open + 1..close])
                        .into_iter()
                        .map(|p| (p[0].clone(), p[2..].to_vec()))
                        .collect();
                    decls.functions.insert(name, (return_tokens, params));
                    i = semicolon + 1;
                }
                _ => i += 1,
            }
        }
        decls
    }

    fn canonical(&self, tokens: &[String]) -> String {
        if tokens.is_empty() {
            return "void".to_string();
        }
        if tokens[0] == "*" {
            let inner = self.canonical(&tokens[2..]);
            return match tokens[1].as_str() {
                "const" => format!("cptr({inner})"),
                "mut" => format!("ptr({inner})"),
                other => panic!("raw pointer without const/mut: {other}"),
            };
        }
        if tokens[0] == "[" {
            let semicolon = tokens.iter().rposition(|t| t == ";").unwrap();
            let element = self.canonical(&tokens[1..semicolon]);
            let extent = &tokens[semicolon + 1];
            let extent = parse_integer(extent).unwrap_or_else(|| self.integer_const(extent));
            return format!("array({element},{extent})");
        }
        let name = tokens.last().unwrap().as_str(); // last path segment
        match name {
            "i8" | "u8" | "i16" | "u16" | "i32" | "u32" | "i64" | "u64" | "usize" | "f32" | "f64" => {
                name.to_string()
            }
            "c_int" => "i32".to_string(),
            "c_uint" => "u32".to_string(),
            "c_char" => "char".to_string(),
            "c_float" => "f32".to_string(),
            "c_void" => "void".to_string(),
            other if self.aliases.contains_key(other) => self.canonical(&self.aliases[other]),
            other if self.structs.contains_key(other) => format!("struct {other}"),
            other => panic!("unknown Rust type '{other}' in {tokens:?}"),
        }
    }

    fn integer_const(&self, name: &str) -> i64 {
        let value = self.consts.get(name).unwrap_or_else(|| panic!("no const {name}"));
        let joined: String = value.concat();
        parse_integer(&joined).unwrap_or_else(|| panic!("const {name} is not an integer: {joined}"))
    }
}

// ---------------------------------------------------------------- fixtures

fn include_dir() -> PathBuf {
    match std::env::var_os("FLASHKDA_INCLUDE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../include"),
    }
}

fn header() -> CHeader {
    CHeader::parse(&include_dir().join("flashkda.h"))
}

fn rust_decls() -> RustDecls {
    RustDecls::parse(include_str!("../src/lib.rs"))
}

// ------------------------------------------------------------------- tests

#[test]
fn every_header_function_is_declared_and_no_other() {
    let header = header();
    let decls = rust_decls();
    assert!(header.functions.len() >= 12, "parsed too few functions: {:?}", header.functions.keys());
    let missing: Vec<_> = header.functions.keys().filter(|f| !decls.functions.contains_key(*f)).collect();
    assert!(missing.is_empty(), "flashkda-sys lacks header functions: {missing:?}");
    let extra: Vec<_> = decls.functions.keys().filter(|f| !header.functions.contains_key(*f)).collect();
    assert!(extra.is_empty(), "flashkda-sys declares functions the header lacks: {extra:?}");
}

#[test]
fn function_signatures_match_the_header() {
    let header = header();
    let decls = rust_decls();
    for (name, (c_return, c_params)) in &header.functions {
        let Some((rust_return, rust_params)) = decls.functions.get(name) else { continue };
        assert_eq!(&decls.canonical(rust_return), c_return, "{name}: return type");
        assert_eq!(rust_params.len(), c_params.len(), "{name}: argument count");
        for ((rust_name, rust_type), (c_name, c_type)) in rust_params.iter().zip(c_params) {
            assert_eq!(rust_name, c_name, "{name}: argument name");
            assert_eq!(&decls.canonical(rust_type), c_type, "{name}({c_name}): type");
        }
    }
}

#[test]
fn struct_fields_match_the_header() {
    let header = header();
    let decls = rust_decls();
    assert_eq!(header.structs.len(), 5, "parsed structs: {:?}", header.structs.keys());
    for (tag, c_fields) in &header.structs {
        let rust_fields = decls.structs.get(tag).unwrap_or_else(|| panic!("flashkda-sys lacks struct {tag}"));
        let rust: Vec<(String, String)> =
            rust_fields.iter().map(|(name, ty)| (name.clone(), decls.canonical(ty))).collect();
        assert_eq!(&rust, c_fields, "struct {tag}");
    }
}

#[test]
fn enum_constants_and_defines_match_the_header() {
    let header = header();
    let decls = rust_decls();
    assert_eq!(header.enums.len(), 4, "parsed enums: {:?}", header.enums.keys());
    for (enum_name, constants) in &header.enums {
        let alias = decls.aliases.get(enum_name).unwrap_or_else(|| panic!("flashkda-sys lacks {enum_name}"));
        assert_eq!(decls.canonical(alias), "i32", "{enum_name} must be a c_int alias");
        for (constant, value) in constants {
            assert_eq!(decls.integer_const(constant), *value, "{constant}");
        }
    }
    for define in ["FKDA_VERSION_MAJOR", "FKDA_VERSION_MINOR", "FKDA_VERSION_PATCH", "FKDA_MAX_RANK"] {
        assert_eq!(decls.integer_const(define), header.defines[define], "{define}");
    }
    let d = &header.defines;
    assert_eq!(
        FKDA_VERSION_NUMBER as i64,
        d["FKDA_VERSION_MAJOR"] * 10000 + d["FKDA_VERSION_MINOR"] * 100 + d["FKDA_VERSION_PATCH"]
    );
}

struct RustLayout {
    tag: &'static str,
    size: usize,
    fields: Vec<(&'static str, usize)>,
}

macro_rules! layout {
    ($ty:ident { $($field:ident),* $(,)? }) => {{
        let value = MaybeUninit::<$ty>::uninit();
        let base = value.as_ptr();
        let fields = vec![$((
            stringify!($field),
            // SAFETY: addr_of! takes the field's address without reading it.
            unsafe { (addr_of!((*base).$field) as *const u8).offset_from(base as *const u8) } as usize,
        )),*];
        RustLayout { tag: stringify!($ty), size: size_of::<$ty>(), fields }
    }};
}

fn rust_layouts() -> Vec<RustLayout> {
    vec![
        layout!(fkda_tensor { data, dtype, rank, shape, strides }),
        layout!(fkda_plan_desc {
            struct_size, num_heads, head_dim_k, head_dim_v, state_dtype, state_layout, backend,
            lower_bound,
        }),
        layout!(fkda_fwd_args {
            struct_size, q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state,
            cu_seqlens, scale,
        }),
        layout!(fkda_device_info {
            struct_size, driver_loaded, driver_version, device_count, device, cc_major, cc_minor,
            has_kernels, name,
        }),
        layout!(fkda_build_info { struct_size, cuda_version, min_driver_version, architectures }),
    ]
}

/// Compiles and runs a C program; returns its output lines.
fn run_c_program(name: &str, body: &str) -> Vec<String> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("flashkda-sys-abi");
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join(format!("{name}.c"));
    let program = dir.join(name);
    std::fs::write(
        &source,
        format!("#include <stdio.h>\n#include <stddef.h>\n#include \"flashkda.h\"\nint main(void) {{\n{body}  return 0;\n}}\n"),
    )
    .unwrap();
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&compiler)
        .arg("-std=c99")
        .arg("-I")
        .arg(include_dir())
        .arg(&source)
        .arg("-o")
        .arg(&program)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler '{compiler}': {e}"));
    assert!(status.success(), "the C compiler failed on {}", source.display());
    let output = Command::new(&program).output().expect("run the layout program");
    assert!(output.status.success());
    String::from_utf8(output.stdout).unwrap().lines().map(str::to_string).collect()
}

#[test]
fn layouts_match_the_c_compiler() {
    let header = header();
    let layouts = rust_layouts();
    let mut body = String::new();
    for (tag, fields) in &header.structs {
        body += &format!("  printf(\"sizeof {tag} %zu\\n\", sizeof(struct {tag}));\n");
        for (field, _) in fields {
            body += &format!("  printf(\"offsetof {tag} {field} %zu\\n\", offsetof(struct {tag}, {field}));\n");
        }
    }
    let scalar_types = ["fkda_status", "fkda_dtype", "fkda_backend", "fkda_state_layout", "fkda_plan_t", "fkda_stream_t"];
    for ty in scalar_types {
        body += &format!("  printf(\"sizeof {ty} %zu\\n\", sizeof({ty}));\n");
    }
    let c: HashMap<String, String> = run_c_program("layout", &body)
        .iter()
        .map(|line| {
            let (key, value) = line.rsplit_once(' ').unwrap();
            (key.to_string(), value.to_string())
        })
        .collect();

    for (tag, c_fields) in &header.structs {
        let layout = layouts
            .iter()
            .find(|l| l.tag == tag)
            .unwrap_or_else(|| panic!("no layout check for struct {tag}: add it to rust_layouts()"));
        let names: Vec<&str> = layout.fields.iter().map(|(name, _)| *name).collect();
        let c_names: Vec<&str> = c_fields.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, c_names, "rust_layouts() lists the fields of {tag}");
        assert_eq!(layout.size.to_string(), c[&format!("sizeof {tag}")], "sizeof({tag})");
        for (field, offset) in &layout.fields {
            assert_eq!(offset.to_string(), c[&format!("offsetof {tag} {field}")], "offsetof({tag}, {field})");
        }
    }
    let rust_scalar_sizes = [
        size_of::<fkda_status>(),
        size_of::<fkda_dtype>(),
        size_of::<fkda_backend>(),
        size_of::<fkda_state_layout>(),
        size_of::<fkda_plan_t>(),
        size_of::<fkda_stream_t>(),
    ];
    for (ty, size) in scalar_types.iter().zip(rust_scalar_sizes) {
        assert_eq!(size.to_string(), c[&format!("sizeof {ty}")], "sizeof({ty})");
    }
}

#[test]
fn init_constants_match_the_macros() {
    let body = r#"
  fkda_tensor none = FKDA_TENSOR_NONE;
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  fkda_build_info build = FKDA_BUILD_INFO_INIT;
  printf("none %d %d %d\n", none.data == NULL, none.dtype, none.rank);
  printf("desc %zu %d %d %d %d %d %d %.9g\n", desc.struct_size, desc.num_heads, desc.head_dim_k,
         desc.head_dim_v, desc.state_dtype, desc.state_layout, desc.backend, desc.lower_bound);
  printf("args %zu %d %.9g\n", args.struct_size, args.q.rank + args.cu_seqlens.rank, args.scale);
  printf("info %zu %d %d\n", info.struct_size, info.device, info.driver_loaded);
  printf("build %zu %d %d\n", build.struct_size, build.cuda_version, build.architectures[0]);
"#;
    let c: HashMap<String, String> = run_c_program("init", body)
        .iter()
        .map(|line| {
            let (what, values) = line.split_once(' ').unwrap();
            (what.to_string(), values.to_string())
        })
        .collect();
    let none = FKDA_TENSOR_NONE;
    assert_eq!(c["none"], format!("{} {} {}", none.data.is_null() as i32, none.dtype, none.rank));
    let desc = FKDA_PLAN_DESC_INIT;
    assert_eq!(
        c["desc"],
        format!(
            "{} {} {} {} {} {} {} {}",
            desc.struct_size, desc.num_heads, desc.head_dim_k, desc.head_dim_v, desc.state_dtype,
            desc.state_layout, desc.backend, desc.lower_bound
        )
    );
    let args = FKDA_FWD_ARGS_INIT;
    let c_args: Vec<&str> = c["args"].split(' ').collect();
    assert_eq!(c_args[0], args.struct_size.to_string());
    assert_eq!(c_args[1], (args.q.rank + args.cu_seqlens.rank).to_string());
    assert_eq!(c_args[2].parse::<f32>().unwrap(), args.scale, "FKDA_FWD_ARGS_INIT scale");
    let info = FKDA_DEVICE_INFO_INIT;
    assert_eq!(c["info"], format!("{} {} {}", info.struct_size, info.device, info.driver_loaded));
    let build = FKDA_BUILD_INFO_INIT;
    assert_eq!(c["build"], format!("{} {} {}", build.struct_size, build.cuda_version, build.architectures[0]));
}
