# SPDX-License-Identifier: MIT
# lintian on both .debs of scripts/make-debs.sh: the test fails on any error
# or warning; what the project accepts is overridden, each override with its
# reason, in cmake/debian/*.lintian-overrides (shipped in the packages).
cmake_policy(VERSION 3.24)
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND bash "${SOURCE_DIR}/scripts/make-debs.sh" "${BUILD_DIR}" "${WORK_DIR}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE made ERROR_VARIABLE log)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "make-debs.sh failed:\n${made}${log}")
endif()
file(GLOB debs "${WORK_DIR}/*.deb")
list(LENGTH debs deb_count)
if(NOT deb_count EQUAL 2)
  message(FATAL_ERROR "make-debs.sh wrote ${deb_count} .debs: ${debs}")
endif()
# Exit status 2 on any error or warning not overridden (--show-overrides
# would count the overridden ones too).
execute_process(COMMAND "${LINTIAN}" --fail-on error,warning --display-info ${debs}
                RESULT_VARIABLE rc OUTPUT_VARIABLE report ERROR_VARIABLE log)
message("${report}${log}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "lintian reports errors or warnings (exit ${rc})")
endif()
string(REGEX MATCH "(^|\n)[EW]: [^\n]*" unexpected "${report}")
if(unexpected)
  message(FATAL_ERROR "lintian: ${unexpected}")
endif()
