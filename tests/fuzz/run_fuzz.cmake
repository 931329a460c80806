# SPDX-License-Identifier: MIT
# Builds the fuzz target (tests/fuzz) with clang in WORK_DIR, then runs it for
# SECONDS seconds over the committed seed corpus. Fails when clang is missing,
# the build fails, the fuzzer stops on a finding, or it ran too few inputs.
# New inputs go to WORK_DIR, never into the source tree.
if(NOT CLANGXX)
  message(FATAL_ERROR "clang++ not found: scripts/install-deps.sh installs clang and libclang-rt-dev")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/fuzz" -B "${WORK_DIR}/build"
                        "-DCMAKE_CXX_COMPILER=${CLANGXX}" "-DFKDA_SOURCE_DIR=${SOURCE_DIR}"
                        "-DFKDA_CUDA_INCLUDE_DIR=${CUDA_INCLUDE_DIR}"
                        "-DFKDA_GENERATED_DIR=${GENERATED_DIR}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the fuzz target failed")
endif()
cmake_host_system_information(RESULT cores QUERY NUMBER_OF_LOGICAL_CORES)
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}/build" -j ${cores} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the fuzz target failed (does clang++ -fsanitize=fuzzer link? libclang-rt-dev)")
endif()

file(MAKE_DIRECTORY "${WORK_DIR}/corpus")
file(GLOB seeds "${SOURCE_DIR}/tests/fuzz/corpus/*")
list(LENGTH seeds seed_count)
if(seed_count EQUAL 0)
  message(FATAL_ERROR "no seeds in ${SOURCE_DIR}/tests/fuzz/corpus")
endif()
execute_process(COMMAND "${WORK_DIR}/build/fkda_fuzz_validation"
                        "${WORK_DIR}/corpus" "${SOURCE_DIR}/tests/fuzz/corpus"
                        -max_total_time=${SECONDS} -timeout=30 -rss_limit_mb=4096
                        -print_final_stats=1 "-artifact_prefix=${WORK_DIR}/"
                RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
message("${log}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the fuzzer stopped on a finding (exit ${rc}); the input is in ${WORK_DIR}/ (crash-*, timeout-*, oom-*)")
endif()
if(NOT log MATCHES "INITED" OR NOT log MATCHES "stat::number_of_executed_units: ([0-9]+)")
  message(FATAL_ERROR "the fuzzer did not run")
endif()
set(runs ${CMAKE_MATCH_1})
math(EXPR least "${seed_count} + 100")
if(runs LESS least)
  message(FATAL_ERROR "the fuzzer ran only ${runs} inputs in ${SECONDS} s (expected at least ${least})")
endif()
message(STATUS "fuzz_validation: ${runs} inputs in ${SECONDS} s, no finding")
