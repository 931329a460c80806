# SPDX-License-Identifier: MIT
# The release artefacts in DIST (scripts/dist.sh): the library inside the
# runtime .deb, the .tar.gz and the wheel must each report CUDA_VERSION and
# MIN_DRIVER_VERSION through fkda_get_build_info, with sm_80 and sm_90a
# machine code; the wheel must carry the licence.
cmake_policy(VERSION 3.24)
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(probe "${WORK_DIR}/build_info")
execute_process(COMMAND cc -std=c99 -Wall -Werror -I${SOURCE_DIR}/include
                        ${CMAKE_CURRENT_LIST_DIR}/build_info.c -ldl -o ${probe}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building ${probe} failed")
endif()

function(only_one pattern out_var)
  file(GLOB found "${DIST}/${pattern}")
  list(LENGTH found count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "expected one ${pattern} in ${DIST}, found: ${found}")
  endif()
  set(${out_var} "${found}" PARENT_SCOPE)
endfunction()
only_one("libflashkda[0-9]*_*.deb" runtime_deb)
only_one("libflashkda-dev_*.deb" dev_deb)
only_one("flashkda-*-Linux.tar.gz" tarball)
only_one("flashkda-*.whl" wheel)
only_one("libflashkda.so.*.debug" debug_file)

execute_process(COMMAND dpkg-deb -x "${runtime_deb}" "${WORK_DIR}/deb" RESULT_VARIABLE rc)
file(ARCHIVE_EXTRACT INPUT "${tarball}" DESTINATION "${WORK_DIR}/tgz")
file(ARCHIVE_EXTRACT INPUT "${wheel}" DESTINATION "${WORK_DIR}/wheel")

foreach(kind IN ITEMS deb tgz wheel)
  file(GLOB_RECURSE library "${WORK_DIR}/${kind}/*libflashkda.so.0")
  list(LENGTH library count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "the ${kind} artefact holds ${count} libflashkda.so.0: ${library}")
  endif()
  execute_process(COMMAND "${probe}" "${library}" OUTPUT_VARIABLE info RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0
     OR NOT info MATCHES "cuda_version=${CUDA_VERSION}\n"
     OR NOT info MATCHES "min_driver_version=${MIN_DRIVER_VERSION}\n"
     OR NOT info MATCHES "architectures=[^\n]*sm_80"
     OR NOT info MATCHES "architectures=[^\n]*sm_90a")
    message(FATAL_ERROR "${library} (${kind}) reports:\n${info}expected CUDA ${CUDA_VERSION}, "
                        "driver floor ${MIN_DRIVER_VERSION}, sm_80 and sm_90a")
  endif()
  message("${kind}: ${library}\n${info}")
endforeach()

file(GLOB metadata "${WORK_DIR}/wheel/flashkda-*.dist-info/METADATA")
file(READ "${metadata}" metadata_text)
file(GLOB wheel_licence "${WORK_DIR}/wheel/flashkda-*.dist-info/licenses/LICENSE")
if(NOT metadata_text MATCHES "\nLicense-Expression: MIT\n" OR NOT wheel_licence)
  message(FATAL_ERROR "${wheel}: no License-Expression: MIT or no licenses/LICENSE")
endif()
