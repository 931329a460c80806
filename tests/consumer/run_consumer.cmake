# SPDX-License-Identifier: MIT
# Installs the built library into a temporary prefix, then configures, builds
# and runs tests/consumer against that prefix only.
include("${CMAKE_CURRENT_LIST_DIR}/consume.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install into ${prefix} failed")
endif()
fkda_consume("${prefix}" "${LIBDIR}" "${WORK_DIR}")
