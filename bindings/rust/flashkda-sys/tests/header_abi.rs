// SPDX-License-Identifier: MIT
//! flashkda-sys against include/flashkda.h.
//!
//! The header's side is the JSON description of bindings/tools/fkda_header.py
//! (declarations, and the sizes, offsets and _INIT values a C compiler
//! reports); this crate's src/lib.rs is parsed (a small parser of exactly
//! the constructs it uses). Every function, struct field, enum constant and
//! define is compared after reducing types to the tool's canonical form:
//! `i32`, `usize`, `char`, `void`, `ptr(T)` (mutable pointee), `cptr(T)`
//! (const pointee), `struct TAG`, `array(T,N)`.
//!
//! FLASHKDA_INCLUDE_DIR overrides where the header is read from; PYTHON the
//! interpreter that runs the tool (default `python3`); CC the C compiler it
//! uses (default `cc`).

use flashkda_sys::*;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_char;
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

// -------------------------------------------------------------------- json

/// The tool's output: objects keep their members in order, numbers are f64
/// (every integer it prints fits one exactly).
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Number(f64),
    Text(String),
    List(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    fn parse(text: &str) -> Json {
        let chars: Vec<char> = text.chars().collect();
        let mut at = 0;
        let value = Json::value(&chars, &mut at);
        Json::skip_space(&chars, &mut at);
        assert_eq!(at, chars.len(), "trailing text after the JSON value");
        value
    }

    fn skip_space(chars: &[char], at: &mut usize) {
        while *at < chars.len() && chars[*at].is_whitespace() {
            *at += 1;
        }
    }

    fn expect(chars: &[char], at: &mut usize, wanted: char) {
        Json::skip_space(chars, at);
        assert_eq!(chars.get(*at), Some(&wanted), "malformed JSON at character {at}");
        *at += 1;
    }

    /// Whether the next character closes a list or object (and steps over it).
    fn closes(chars: &[char], at: &mut usize, close: char) -> bool {
        Json::skip_space(chars, at);
        if chars[*at] == close {
            *at += 1;
            return true;
        }
        if chars[*at] == ',' {
            *at += 1;
        }
        false
    }

    fn value(chars: &[char], at: &mut usize) -> Json {
        Json::skip_space(chars, at);
        let word = |w: &str| chars[*at..].iter().take(w.len()).collect::<String>() == w;
        match chars[*at] {
            '{' => {
                *at += 1;
                let mut members = Vec::new();
                while !Json::closes(chars, at, '}') {
                    let Json::Text(key) = Json::value(chars, at) else { panic!("object key is not a string") };
                    Json::expect(chars, at, ':');
                    members.push((key, Json::value(chars, at)));
                }
                Json::Object(members)
            }
            '[' => {
                *at += 1;
                let mut items = Vec::new();
                while !Json::closes(chars, at, ']') {
                    items.push(Json::value(chars, at));
                }
                Json::List(items)
            }
            '"' => {
                *at += 1;
                let mut text = String::new();
                while chars[*at] != '"' {
                    if chars[*at] == '\\' {
                        *at += 1;
                        text.push(match chars[*at] {
                            'n' => '\n',
                            't' => '\t',
                            'u' => {
                                let hex: String = chars[*at + 1..*at + 5].iter().collect();
                                *at += 4;
                                char::from_u32(u32::from_str_radix(&hex, 16).unwrap()).unwrap()
                            }
                            other => other,
                        });
                    } else {
                        text.push(chars[*at]);
                    }
                    *at += 1;
                }
                *at += 1;
                Json::Text(text)
            }
            _ if word("null") => {
                *at += 4;
                Json::Null
            }
            _ if word("true") => {
                *at += 4;
                Json::Bool(true)
            }
            _ if word("false") => {
                *at += 5;
                Json::Bool(false)
            }
            _ => {
                let start = *at;
                while *at < chars.len() && matches!(chars[*at], '-' | '+' | '.' | 'e' | 'E' | '0'..='9') {
                    *at += 1;
                }
                let number: String = chars[start..*at].iter().collect();
                Json::Number(number.parse().unwrap_or_else(|_| panic!("bad JSON number '{number}'")))
            }
        }
    }

    fn get(&self, key: &str) -> &Json {
        self.members()
            .iter()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value)
            .unwrap_or_else(|| panic!("no member '{key}' in the header description"))
    }

    fn members(&self) -> &[(String, Json)] {
        match self {
            Json::Object(members) => members,
            other => panic!("expected an object, got {other:?}"),
        }
    }

    fn items(&self) -> &[Json] {
        match self {
            Json::List(items) => items,
            other => panic!("expected a list, got {other:?}"),
        }
    }

    fn text(&self) -> &str {
        match self {
            Json::Text(text) => text,
            other => panic!("expected a string, got {other:?}"),
        }
    }

    fn integer(&self) -> i64 {
        match self {
            Json::Number(number) if number.fract() == 0.0 => *number as i64,
            other => panic!("expected an integer, got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------- fixtures

fn include_dir() -> PathBuf {
    match std::env::var_os("FLASHKDA_INCLUDE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../include"),
    }
}

/// The header as bindings/tools/fkda_header.py describes it.
fn header() -> Json {
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fkda_header.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let output = Command::new(&python)
        .arg(&tool)
        .arg(include_dir().join("flashkda.h"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} {}: {e}", tool.display()));
    assert!(
        output.status.success(),
        "{} failed:\n{}",
        tool.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Json::parse(std::str::from_utf8(&output.stdout).expect("the tool prints UTF-8"))
}

fn rust_decls() -> RustDecls {
    RustDecls::parse(include_str!("../src/lib.rs"))
}

// ------------------------------------------------------------------- tests

#[test]
fn every_header_function_is_declared_and_no_other() {
    let header = header();
    let decls = rust_decls();
    let functions: Vec<&String> = header.get("functions").members().iter().map(|(name, _)| name).collect();
    let missing: Vec<_> = functions.iter().filter(|f| !decls.functions.contains_key(f.as_str())).collect();
    assert!(missing.is_empty(), "flashkda-sys lacks header functions: {missing:?}");
    let extra: Vec<_> = decls.functions.keys().filter(|f| !functions.contains(f)).collect();
    assert!(extra.is_empty(), "flashkda-sys declares functions the header lacks: {extra:?}");
}

#[test]
fn function_signatures_match_the_header() {
    let header = header();
    let decls = rust_decls();
    for (name, function) in header.get("functions").members() {
        let Some((rust_return, rust_params)) = decls.functions.get(name) else { continue };
        let c_params = function.get("params").items();
        assert_eq!(decls.canonical(rust_return), function.get("return").get("canonical").text(), "{name}: return type");
        assert_eq!(rust_params.len(), c_params.len(), "{name}: argument count");
        for ((rust_name, rust_type), c_param) in rust_params.iter().zip(c_params) {
            let c_name = c_param.get("name").text();
            assert_eq!(rust_name, c_name, "{name}: argument name");
            assert_eq!(decls.canonical(rust_type), c_param.get("canonical").text(), "{name}({c_name}): type");
        }
    }
}

#[test]
fn struct_fields_match_the_header() {
    let header = header();
    let decls = rust_decls();
    for (tag, layout) in header.get("structs").members() {
        let rust_fields = decls.structs.get(tag).unwrap_or_else(|| panic!("flashkda-sys lacks struct {tag}"));
        let rust: Vec<(String, String)> =
            rust_fields.iter().map(|(name, ty)| (name.clone(), decls.canonical(ty))).collect();
        let c: Vec<(String, String)> = layout
            .get("fields")
            .items()
            .iter()
            .map(|f| (f.get("name").text().to_string(), f.get("canonical").text().to_string()))
            .collect();
        assert_eq!(rust, c, "struct {tag}");
    }
}

#[test]
fn enum_constants_and_defines_match_the_header() {
    let header = header();
    let decls = rust_decls();
    for (enum_name, description) in header.get("enums").members() {
        let alias = decls.aliases.get(enum_name).unwrap_or_else(|| panic!("flashkda-sys lacks {enum_name}"));
        assert_eq!(decls.canonical(alias), "i32", "{enum_name} must be a c_int alias");
        assert_eq!(description.get("size").integer(), size_of::<i32>() as i64, "sizeof({enum_name})");
        for (constant, value) in description.get("constants").members() {
            assert_eq!(decls.integer_const(constant), value.integer(), "{constant}");
        }
    }
    for (define, value) in header.get("defines").members() {
        assert_eq!(decls.integer_const(define), value.integer(), "{define}");
    }
    let d = |name: &str| header.get("defines").get(name).integer();
    assert_eq!(
        FKDA_VERSION_NUMBER as i64,
        d("FKDA_VERSION_MAJOR") * 10000 + d("FKDA_VERSION_MINOR") * 100 + d("FKDA_VERSION_PATCH")
    );
}

#[test]
fn opaque_handles_are_pointers() {
    let header = header();
    let decls = rust_decls();
    for (name, description) in header.get("typedefs").members() {
        let alias = decls.aliases.get(name).unwrap_or_else(|| panic!("flashkda-sys lacks {name}"));
        assert_eq!(decls.canonical(alias), description.get("canonical").text(), "{name}");
        assert_eq!(description.get("size").integer(), size_of::<*mut u8>() as i64, "sizeof({name})");
    }
}

/// A value as the tool prints an _INIT macro's: pointers as addresses,
/// char arrays as strings, structs as objects in field order.
trait AsJson {
    fn as_json(&self) -> Json;
}

macro_rules! numbers_as_json {
    ($($ty:ty),*) => {$(
        impl AsJson for $ty {
            fn as_json(&self) -> Json {
                Json::Number(*self as f64)
            }
        }
    )*};
}
numbers_as_json!(i32, u32, i64, usize, f32);

impl<T> AsJson for *mut T {
    fn as_json(&self) -> Json {
        Json::Number(*self as usize as f64)
    }
}

impl<T: AsJson, const N: usize> AsJson for [T; N] {
    fn as_json(&self) -> Json {
        Json::List(self.iter().map(AsJson::as_json).collect())
    }
}

impl<const N: usize> AsJson for [c_char; N] {
    fn as_json(&self) -> Json {
        Json::Text(self.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect())
    }
}

/// What the Rust side says about one of the header's structs.
struct RustMirror {
    tag: &'static str,
    size: usize,
    fields: Vec<(&'static str, usize)>,
    init_macro: &'static str,
    init: Json,
}

/// Each struct mirror of flashkda-sys with its fields and its _INIT
/// constant, listed once: Rust cannot enumerate a struct's fields itself.
macro_rules! mirrors {
    ($($ty:ident = $init:ident { $($field:ident),* $(,)? })*) => {
        $(impl AsJson for $ty {
            fn as_json(&self) -> Json {
                Json::Object(vec![$((stringify!($field).to_string(), self.$field.as_json())),*])
            }
        })*

        fn rust_mirrors() -> Vec<RustMirror> {
            vec![$({
                let value = MaybeUninit::<$ty>::uninit();
                let base = value.as_ptr();
                let fields = vec![$((
                    stringify!($field),
                    // SAFETY: addr_of! takes the field's address without reading it.
                    unsafe { (addr_of!((*base).$field) as *const u8).offset_from(base as *const u8) } as usize,
                )),*];
                RustMirror {
                    tag: stringify!($ty),
                    size: size_of::<$ty>(),
                    fields,
                    init_macro: stringify!($init),
                    init: $init.as_json(),
                }
            }),*]
        }
    };
}

mirrors! {
    fkda_tensor = FKDA_TENSOR_NONE { data, dtype, rank, shape, strides }
    fkda_plan_desc = FKDA_PLAN_DESC_INIT {
        struct_size, num_heads, head_dim_k, head_dim_v, state_dtype, state_layout, backend,
        lower_bound, null_slot_rule, debug_checks, gate_mode, beta_mode, vsplit, chunk_parallel,
        window_slots, segment_chunks, layer_step,
    }
    fkda_layer_step = FKDA_LAYER_STEP_INIT {
        conv_weight_q, conv_weight_k, conv_weight_v, conv_bias_q, conv_bias_k, conv_bias_v,
        conv_state_q, conv_state_k, conv_state_v, out_gate, out_norm_weight, out_norm_eps,
        reserved,
    }
    fkda_fwd_args = FKDA_FWD_ARGS_INIT {
        struct_size, q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state,
        cu_seqlens, scale, state_pool, state_indices, has_initial_state, checkpoint_offsets,
        checkpoints, checkpoint_slots, layer,
    }
    fkda_decode_args = FKDA_DECODE_ARGS_INIT {
        struct_size, q, k, v, g, beta, A_log, dt_bias, out, state_pool, state_indices,
        num_accepted_tokens, cu_seqlens, scale, layer,
    }
    fkda_transition_args = FKDA_TRANSITION_ARGS_INIT {
        struct_size, k, v, g, beta, A_log, dt_bias, cu_seqlens, transition_m, transition_e,
    }
    fkda_apply_args = FKDA_APPLY_ARGS_INIT {
        struct_size, transition_m, transition_e, initial_state, final_state,
    }
    fkda_device_info = FKDA_DEVICE_INFO_INIT {
        struct_size, driver_loaded, driver_version, device_count, device, cc_major, cc_minor,
        has_kernels, name,
    }
    fkda_launch_report = FKDA_LAUNCH_REPORT_INIT {
        struct_size, vsplit, windows, slots_per_window, chunk_parallel, segment_chunks,
    }
    fkda_build_info = FKDA_BUILD_INFO_INIT { struct_size, cuda_version, min_driver_version, architectures }
}

#[test]
fn layouts_and_init_values_match_the_c_compiler() {
    let header = header();
    let mirrors = rust_mirrors();
    for (tag, layout) in header.get("structs").members() {
        let mirror = mirrors
            .iter()
            .find(|m| m.tag == tag)
            .unwrap_or_else(|| panic!("no mirror of struct {tag}: add it to mirrors!"));
        let c_fields = layout.get("fields").items();
        let names: Vec<&str> = mirror.fields.iter().map(|(name, _)| *name).collect();
        let c_names: Vec<&str> = c_fields.iter().map(|f| f.get("name").text()).collect();
        assert_eq!(names, c_names, "mirrors! lists the fields of {tag}");
        assert_eq!(mirror.size as i64, layout.get("size").integer(), "sizeof({tag})");
        for ((field, offset), c_field) in mirror.fields.iter().zip(c_fields) {
            assert_eq!(*offset as i64, c_field.get("offset").integer(), "offsetof({tag}, {field})");
        }
        let init = layout.get("init");
        assert_eq!(mirror.init_macro, init.get("macro").text(), "the _INIT macro of {tag}");
        assert_eq!(&mirror.init, init.get("values"), "{} against the header's", mirror.init_macro);
    }
}
