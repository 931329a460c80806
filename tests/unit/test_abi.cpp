// SPDX-License-Identifier: MIT
// The binary contract: what the shared object exports, what it needs, and
// the layout of every struct that crosses the ABI.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "abi_struct.h"
#include "flashkda.h"

namespace {

std::vector<std::string> run_lines(const std::string& command) {
  std::vector<std::string> lines;
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) {
    std::string line(buffer);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    lines.push_back(line);
  }
  REQUIRE(pclose(pipe) == 0);
  return lines;
}

// One entry of `readelf --dyn-syms`: "fkda_fwd@@FLASHKDA_0" is a defined,
// versioned export; "dlopen@GLIBC_2.2.5 (4)" an undefined, versioned need.
struct DynSym {
  std::string name;
  std::string version;  // empty when unversioned
  bool defined = false;
  bool weak = false;
};

std::vector<DynSym> dynamic_symbols() {
  std::vector<DynSym> symbols;
  for (const std::string& line : run_lines(std::string(FKDA_READELF) + " -W --dyn-syms " + FKDA_LIBRARY_FILE)) {
    std::istringstream fields(line);
    std::string num, value, size, type, bind, vis, ndx, name;
    if (!(fields >> num >> value >> size >> type >> bind >> vis >> ndx >> name)) continue;
    if (num.empty() || num.back() != ':' || num == "Num:") continue;
    DynSym sym;
    const size_t at = name.find('@');
    sym.name = name.substr(0, at);
    if (at != std::string::npos) sym.version = name.substr(name.find_first_not_of('@', at));
    sym.defined = ndx != "UND";
    sym.weak = bind == "WEAK";
    if (!sym.name.empty()) symbols.push_back(sym);
  }
  return symbols;
}

// "GLIBC_2.28" -> {2, 28}; "GCC_4.2.0" -> {4, 2, 0}.
std::vector<int> version_numbers(const std::string& version) {
  std::vector<int> numbers;
  std::istringstream parts(version.substr(version.find('_') + 1));
  std::string part;
  while (std::getline(parts, part, '.')) numbers.push_back(std::stoi(part));
  return numbers;
}

// Every function flashkda.h declares: the FKDA_API declarations, whose name
// is the identifier before the parameter list.
std::set<std::string> header_functions() {
  std::ifstream header(std::string(FKDA_SOURCE_DIR) + "/include/flashkda.h");
  REQUIRE(header.good());
  std::stringstream text;
  text << header.rdbuf();
  const std::string all = text.str();
  std::set<std::string> names;
  const std::regex declaration(R"(FKDA_API[^;(]*?\b(fkda_[A-Za-z0-9_]+)\s*\()");
  for (auto it = std::sregex_iterator(all.begin(), all.end(), declaration); it != std::sregex_iterator(); ++it) {
    names.insert((*it)[1]);
  }
  return names;
}

}  // namespace

TEST_CASE("the exports are exactly the functions flashkda.h declares", "[abi]") {
  const std::set<std::string> declared = header_functions();
  // Guards the parser: these have been in every release.
  for (const char* name : {"fkda_plan_create", "fkda_fwd", "fkda_decode", "fkda_plan_decode_workspace_size",
                           "fkda_plan_get_launch_report", "fkda_get_build_info", "fkda_last_error"}) {
    INFO("not found among the header's declarations: " << name);
    CHECK(declared.count(name) == 1);
  }
  std::set<std::string> exported;
  for (const DynSym& sym : dynamic_symbols()) {
    if (sym.defined && sym.name.rfind("fkda_", 0) == 0) exported.insert(sym.name);
  }
  for (const std::string& name : declared) {
    INFO("declared in flashkda.h but not exported: " << name);
    CHECK(exported.count(name) == 1);
  }
  for (const std::string& name : exported) {
    INFO("exported but not declared in flashkda.h: " << name);
    CHECK(declared.count(name) == 1);
  }
}

TEST_CASE("only fkda_* symbols are exported, each under the version node FLASHKDA_0", "[abi]") {
  const std::string node = "FLASHKDA_" + std::to_string(FKDA_ABI_VERSION);
  std::vector<std::string> exported;
  for (const DynSym& sym : dynamic_symbols()) {
    if (!sym.defined || sym.name == node) continue;  // the node itself is an ABS entry
    INFO("exported symbol: " << sym.name << "@" << sym.version);
    CHECK(sym.name.rfind("fkda_", 0) == 0);
    CHECK(sym.version == node);
    exported.push_back(sym.name);
  }
  REQUIRE(exported.size() >= 12);
  for (const char* required : {"fkda_plan_create", "fkda_plan_destroy", "fkda_fwd", "fkda_set_lower_bound",
                               "fkda_get_lower_bound", "fkda_plan_workspace_size", "fkda_status_string",
                               "fkda_last_error", "fkda_version", "fkda_version_string",
                               "fkda_query_device", "fkda_plan_get_backend", "fkda_get_build_info"}) {
    INFO("missing export: " << required);
    CHECK(std::find(exported.begin(), exported.end(), required) != exported.end());
  }
}

TEST_CASE("no symbol version above the glibc floor is needed", "[floor]") {
  const std::vector<int> glibc_floor = version_numbers(std::string("GLIBC_") + FKDA_GLIBC_FLOOR);
  // libgcc_s.so.1 of GCC 8, the oldest one a glibc 2.28 distribution ships.
  const std::vector<int> gcc_floor = {7, 0, 0};
  int needs = 0;
  for (const DynSym& sym : dynamic_symbols()) {
    if (sym.defined) continue;
    INFO("needed symbol: " << sym.name << (sym.version.empty() ? "" : "@") << sym.version);
    if (sym.version.empty()) {
      CHECK(sym.weak);  // unversioned references may only be optional ones
    } else if (sym.version.rfind("GLIBC_", 0) == 0) {
      CHECK(version_numbers(sym.version) <= glibc_floor);
    } else if (sym.version.rfind("GCC_", 0) == 0) {
      CHECK(version_numbers(sym.version) <= gcc_floor);
    } else {
      FAIL_CHECK("a version outside glibc and libgcc_s (GLIBCXX_ and CXXABI_ mean a libstdc++ dependency)");
    }
    ++needs;
  }
  CHECK(needs > 0);
}

TEST_CASE("DT_NEEDED lists only libraries every glibc distribution has", "[floor]") {
  const std::vector<std::string> allowed = {"libc.so.6",       "libm.so.6",  "libdl.so.2",
                                            "libpthread.so.0", "librt.so.1", "libgcc_s.so.1",
                                            "ld-linux-x86-64.so.2"};
  std::vector<std::string> needed;
  for (const std::string& line : run_lines(std::string(FKDA_READELF) + " -d " + FKDA_LIBRARY_FILE)) {
    if (line.find("(NEEDED)") == std::string::npos) continue;
    const size_t open = line.find('[');
    needed.push_back(line.substr(open + 1, line.find(']') - open - 1));
  }
  REQUIRE_FALSE(needed.empty());
  for (const std::string& library : needed) {
    INFO("DT_NEEDED: " << library);
    CHECK(std::find(allowed.begin(), allowed.end(), library) != allowed.end());
  }
}

TEST_CASE("SONAME carries the ABI major", "[abi]") {
  bool soname_ok = false;
  for (const std::string& line : run_lines(std::string(FKDA_READELF) + " -d " + FKDA_LIBRARY_FILE)) {
    if (line.find("(SONAME)") != std::string::npos) {
      soname_ok = line.find("[libflashkda.so." + std::to_string(FKDA_ABI_VERSION) + "]") != std::string::npos;
    }
  }
  CHECK(soname_ok);
}

TEST_CASE("the embedded fatbin is present and stays private", "[abi]") {
  auto lines = run_lines(std::string(FKDA_NM) + " " + FKDA_LIBRARY_FILE + " | grep -c flashkda_embedded_fatbin || true");
  REQUIRE(lines.size() == 1);
  CHECK(std::stoi(lines[0]) >= 1);
}

TEST_CASE("struct layouts are frozen", "[abi]") {
  // LP64 layouts; bindings mirror them, so any change here breaks callers.
  STATIC_REQUIRE(sizeof(fkda_tensor) == 112);
  STATIC_REQUIRE(offsetof(fkda_tensor, dtype) == 8);
  STATIC_REQUIRE(offsetof(fkda_tensor, rank) == 12);
  STATIC_REQUIRE(offsetof(fkda_tensor, shape) == 16);
  STATIC_REQUIRE(offsetof(fkda_tensor, strides) == 64);
  // 0.1 ended fkda_plan_desc after lower_bound and fkda_fwd_args after
  // scale: those prefixes never move; 0.2 and 0.3 appended after them.
  STATIC_REQUIRE(offsetof(fkda_plan_desc, num_heads) == 8);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, lower_bound) == 32);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, null_slot_rule) == 36);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, debug_checks) == 40);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, gate_mode) == 44);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, beta_mode) == 48);
  // 0.4's vsplit sits in 0.3's trailing padding (sizeof 56 then).
  STATIC_REQUIRE(offsetof(fkda_plan_desc, vsplit) == 52);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, chunk_parallel) == 56);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, window_slots) == 64);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, segment_chunks) == 72);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, layer_step) == 80);
  STATIC_REQUIRE(sizeof(fkda_plan_desc) == 88);
  STATIC_REQUIRE(sizeof(fkda_layer_step) == 11 * 112 + 8);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, q) == 8);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, cu_seqlens) == 8 + 10 * 112);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, scale) == 8 + 11 * 112);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, state_pool) == 1248);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, checkpoint_slots) == 1248 + 5 * 112);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, layer) == 1248 + 6 * 112);
  STATIC_REQUIRE(sizeof(fkda_fwd_args) == 1248 + 6 * 112 + sizeof(fkda_layer_step));
  STATIC_REQUIRE(offsetof(fkda_decode_args, cu_seqlens) == 8 + 11 * 112);
  STATIC_REQUIRE(offsetof(fkda_decode_args, scale) == 8 + 12 * 112);
  STATIC_REQUIRE(offsetof(fkda_decode_args, layer) == 8 + 12 * 112 + 8);
  STATIC_REQUIRE(sizeof(fkda_decode_args) == 8 + 12 * 112 + 8 + sizeof(fkda_layer_step));
  STATIC_REQUIRE(offsetof(fkda_device_info, name) == 36);
  STATIC_REQUIRE(sizeof(fkda_device_info) == 296);
  STATIC_REQUIRE(offsetof(fkda_launch_report, vsplit) == 8);
  STATIC_REQUIRE(offsetof(fkda_launch_report, slots_per_window) == 24);
  STATIC_REQUIRE(offsetof(fkda_launch_report, chunk_parallel) == 32);
  STATIC_REQUIRE(sizeof(fkda_launch_report) == 48);
  STATIC_REQUIRE(offsetof(fkda_transition_args, k) == 8);
  STATIC_REQUIRE(offsetof(fkda_transition_args, transition_e) == 8 + 8 * 112);
  STATIC_REQUIRE(sizeof(fkda_transition_args) == 8 + 9 * 112);
  STATIC_REQUIRE(offsetof(fkda_apply_args, final_state) == 8 + 3 * 112);
  STATIC_REQUIRE(sizeof(fkda_apply_args) == 8 + 4 * 112);
  STATIC_REQUIRE(offsetof(fkda_build_info, min_driver_version) == 12);
  STATIC_REQUIRE(offsetof(fkda_build_info, architectures) == 16);
  STATIC_REQUIRE(sizeof(fkda_build_info) == 80);
}

namespace {

#define FIELD_END(S, f) (offsetof(S, f) + sizeof(static_cast<S*>(nullptr)->f))

// A release's layout from flashkda.h: its version, the field it ended with,
// and its sizeof (that end rounded up to the struct's alignment).
template <typename S>
fkda::StructRelease layout(const char* version, size_t fields_end) {
  return {version, (fields_end + alignof(S) - 1) / alignof(S) * alignof(S), fields_end};
}

template <typename S>
void check_release_table(const std::vector<fkda::StructRelease>& expected) {
  const auto& rows = fkda::AbiStruct<S>::releases;
  const size_t count = sizeof rows / sizeof rows[0];
  INFO(fkda::AbiStruct<S>::name);
  REQUIRE(count == expected.size());
  for (size_t i = 0; i < count; ++i) {
    INFO("release " << expected[i].version);
    CHECK(std::string(rows[i].version) == expected[i].version);
    CHECK(rows[i].size == expected[i].size);
    CHECK(rows[i].fields_end == expected[i].fields_end);
    // Each release's size is new: a size names one release.
    if (i > 0) CHECK(rows[i].size > rows[i - 1].size);
  }
  CHECK(rows[count - 1].size == sizeof(S));
}

}  // namespace

// Which field each release ended each struct with, from CHANGELOG.md and the
// history of flashkda.h. A new release appends a row here and in
// src/abi_struct.h.
TEST_CASE("the table of struct sizes per release matches flashkda.h", "[abi]") {
  using P = fkda_plan_desc;
  check_release_table<P>({layout<P>("0.1", FIELD_END(P, lower_bound)), layout<P>("0.2", FIELD_END(P, debug_checks)),
                          layout<P>("0.3", FIELD_END(P, beta_mode)), layout<P>("0.4", FIELD_END(P, segment_chunks)),
                          layout<P>("0.5", FIELD_END(P, layer_step))});
  using F = fkda_fwd_args;
  check_release_table<F>({layout<F>("0.1", FIELD_END(F, scale)), layout<F>("0.2", FIELD_END(F, checkpoint_slots)),
                          layout<F>("0.5", FIELD_END(F, layer))});
  using D = fkda_decode_args;
  check_release_table<D>({layout<D>("0.2", FIELD_END(D, scale)), layout<D>("0.5", FIELD_END(D, layer))});
  using T = fkda_transition_args;
  check_release_table<T>({layout<T>("0.4", FIELD_END(T, transition_e))});
  using A = fkda_apply_args;
  check_release_table<A>({layout<A>("0.4", FIELD_END(A, final_state))});
  using I = fkda_device_info;
  check_release_table<I>({layout<I>("0.1", FIELD_END(I, name))});
  using B = fkda_build_info;
  check_release_table<B>({layout<B>("0.2", FIELD_END(B, architectures))});
  using R = fkda_launch_report;
  check_release_table<R>({layout<R>("0.2", FIELD_END(R, slots_per_window)), layout<R>("0.4", FIELD_END(R, segment_chunks))});
}

TEST_CASE("build info names the kernels' CUDA version, images and driver floor", "[abi]") {
  fkda_build_info info = FKDA_BUILD_INFO_INIT;
  REQUIRE(fkda_get_build_info(&info) == FKDA_SUCCESS);
  CHECK(info.cuda_version >= 12000);
  // The floor is the toolkit's CUDA major.0 (minor version compatibility).
  CHECK(info.min_driver_version == info.cuda_version / 1000 * 1000);
  const std::string archs = info.architectures;
  CHECK(archs.find("sm_80") != std::string::npos);
  CHECK(archs.find("sm_90a") != std::string::npos);

  CHECK(fkda_get_build_info(nullptr) == FKDA_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(fkda_last_error()).rfind("info: ", 0) == 0);
  info.struct_size = 8;
  CHECK(fkda_get_build_info(&info) == FKDA_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(fkda_last_error()).find("FKDA_BUILD_INFO_INIT") != std::string::npos);
}

TEST_CASE("run-time version matches the header", "[abi]") {
  CHECK(fkda_version() == FKDA_VERSION_NUMBER);
  CHECK(std::string(fkda_version_string()) ==
        std::to_string(FKDA_VERSION_MAJOR) + "." + std::to_string(FKDA_VERSION_MINOR) + "." +
            std::to_string(FKDA_VERSION_PATCH));
}

TEST_CASE("every status has its own text", "[abi]") {
  std::vector<std::string> texts;
  for (int s = FKDA_SUCCESS; s <= FKDA_ERROR_INTERNAL; ++s) {
    std::string text = fkda_status_string(static_cast<fkda_status>(s));
    CHECK_FALSE(text.empty());
    CHECK(std::find(texts.begin(), texts.end(), text) == texts.end());
    texts.push_back(text);
  }
  CHECK(std::string(fkda_status_string(static_cast<fkda_status>(1234))) == "unknown status");
}

TEST_CASE("the library works without a GPU driver", "[abi]") {
  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  REQUIRE(fkda_query_device(-1, &info) == FKDA_SUCCESS);
  if (info.driver_loaded == 0) {
    CHECK(info.device_count == 0);
    CHECK(info.device == -1);
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = 1;
    fkda_plan_t plan = nullptr;
    REQUIRE(fkda_plan_create(&desc, &plan) == FKDA_SUCCESS);  // AUTO falls back to the CPU
    fkda_backend backend = FKDA_BACKEND_AUTO;
    REQUIRE(fkda_plan_get_backend(plan, &backend) == FKDA_SUCCESS);
    CHECK(backend == FKDA_BACKEND_CPU);
    fkda_plan_destroy(plan);
    desc.backend = FKDA_BACKEND_GPU;
    CHECK(fkda_plan_create(&desc, &plan) == FKDA_ERROR_NO_DEVICE);
    CHECK(std::string(fkda_last_error()).find("desc.backend: GPU requested but no usable CUDA driver") == 0);
    CHECK(plan == nullptr);
  } else {
    // With a driver, what it reports must hold together, and AUTO and GPU
    // plans must follow it: errors, not a note, so a GPU machine checks too.
    CHECK(info.driver_version > 0);
    CHECK(info.device_count >= 0);
    CHECK((info.device_count == 0) == (info.device == -1));
    const bool usable = info.device_count > 0 && info.has_kernels == 1;
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = 1;
    fkda_plan_t plan = nullptr;
    REQUIRE(fkda_plan_create(&desc, &plan) == FKDA_SUCCESS);
    fkda_backend backend = FKDA_BACKEND_AUTO;
    REQUIRE(fkda_plan_get_backend(plan, &backend) == FKDA_SUCCESS);
    CHECK(backend == (usable ? FKDA_BACKEND_GPU : FKDA_BACKEND_CPU));
    fkda_plan_destroy(plan);
    plan = nullptr;
    desc.backend = FKDA_BACKEND_GPU;
    const fkda_status status = fkda_plan_create(&desc, &plan);
    CHECK((status == FKDA_SUCCESS) == usable);
    if (!usable) CHECK(std::string(fkda_last_error()).rfind("desc.backend: GPU requested but ", 0) == 0);
    fkda_plan_destroy(plan);
  }
}
