# SPDX-License-Identifier: MIT
# Writes OUTPUT, a header that names the commit of SOURCE_DIR (git describe
# --always --dirty; empty outside a git checkout), rewriting it only when the
# description changed, so that an unchanged tree rebuilds nothing.
find_package(Git QUIET)
set(describe "")
if(GIT_FOUND)
  execute_process(
    COMMAND ${GIT_EXECUTABLE} describe --always --dirty
    WORKING_DIRECTORY ${SOURCE_DIR}
    OUTPUT_VARIABLE describe
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE result
    ERROR_QUIET)
  if(NOT result EQUAL 0)
    set(describe "")
  endif()
endif()
set(content "#define FKDA_BENCH_GIT_DESCRIBE \"${describe}\"\n")
set(old "")
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} old)
endif()
if(NOT old STREQUAL content)
  file(WRITE ${OUTPUT} "${content}")
endif()
