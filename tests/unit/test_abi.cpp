// The binary contract: what the shared object exports, what it needs, and
// the layout of every struct that crosses the ABI.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

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

}  // namespace

TEST_CASE("only fkda_* symbols are exported", "[abi]") {
  auto lines = run_lines(std::string(FKDA_NM) + " -D --defined-only " + FKDA_LIBRARY_FILE);
  std::vector<std::string> exported;
  for (const std::string& line : lines) {
    // "<address> <type> <name>[@version]"
    auto last_space = line.rfind(' ');
    if (last_space == std::string::npos) continue;
    std::string name = line.substr(last_space + 1);
    name = name.substr(0, name.find('@'));
    exported.push_back(name);
  }
  REQUIRE(exported.size() >= 12);
  for (const std::string& name : exported) {
    INFO("exported symbol: " << name);
    CHECK(name.rfind("fkda_", 0) == 0);
  }
  for (const char* required : {"fkda_plan_create", "fkda_plan_destroy", "fkda_fwd", "fkda_set_lower_bound",
                               "fkda_get_lower_bound", "fkda_plan_workspace_size", "fkda_status_string",
                               "fkda_last_error", "fkda_version", "fkda_version_string",
                               "fkda_query_device", "fkda_plan_get_backend"}) {
    INFO("missing export: " << required);
    CHECK(std::find(exported.begin(), exported.end(), required) != exported.end());
  }
}

TEST_CASE("SONAME carries the ABI major and no CUDA library is needed", "[abi]") {
  auto lines = run_lines(std::string(FKDA_READELF) + " -d " + FKDA_LIBRARY_FILE);
  bool soname_ok = false;
  std::vector<std::string> needed;
  for (const std::string& line : lines) {
    if (line.find("(SONAME)") != std::string::npos) {
      soname_ok = line.find("[libflashkda.so.0]") != std::string::npos;
    }
    if (line.find("(NEEDED)") != std::string::npos) needed.push_back(line);
  }
  CHECK(soname_ok);
  REQUIRE_FALSE(needed.empty());
  for (const std::string& line : needed) {
    INFO(line);
    CHECK(line.find("libcuda") == std::string::npos);
    CHECK(line.find("libcudart") == std::string::npos);
    // The C++ runtime is linked statically so the library drops into any runtime.
    CHECK(line.find("libstdc++") == std::string::npos);
  }
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
  // scale: those prefixes never move; 0.2 appended after them.
  STATIC_REQUIRE(offsetof(fkda_plan_desc, num_heads) == 8);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, lower_bound) == 32);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, null_slot_rule) == 36);
  STATIC_REQUIRE(offsetof(fkda_plan_desc, debug_checks) == 40);
  STATIC_REQUIRE(sizeof(fkda_plan_desc) == 48);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, q) == 8);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, cu_seqlens) == 8 + 10 * 112);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, scale) == 8 + 11 * 112);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, state_pool) == 1248);
  STATIC_REQUIRE(offsetof(fkda_fwd_args, checkpoint_slots) == 1248 + 5 * 112);
  STATIC_REQUIRE(sizeof(fkda_fwd_args) == 1248 + 6 * 112);
  STATIC_REQUIRE(offsetof(fkda_decode_args, cu_seqlens) == 8 + 11 * 112);
  STATIC_REQUIRE(offsetof(fkda_decode_args, scale) == 8 + 12 * 112);
  STATIC_REQUIRE(sizeof(fkda_decode_args) == 8 + 12 * 112 + 8);
  STATIC_REQUIRE(offsetof(fkda_device_info, name) == 36);
  STATIC_REQUIRE(sizeof(fkda_device_info) == 296);
  STATIC_REQUIRE(offsetof(fkda_launch_report, vsplit) == 8);
  STATIC_REQUIRE(offsetof(fkda_launch_report, slots_per_window) == 24);
  STATIC_REQUIRE(sizeof(fkda_launch_report) == 32);
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
    WARN("a CUDA driver is present: the no-driver path is not exercised here");
  }
}
