# cpack's packages of the build: the .debs' metadata and contents, then
# tests/consumer built and run against the .debs extracted into a scratch
# root (find_package and pkg-config), and the .tar.gz's install tree.
include("${CMAKE_CURRENT_LIST_DIR}/consume.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND "${CPACK}" -G "DEB;TGZ" --config "${BUILD_DIR}/CPackConfig.cmake" -B "${WORK_DIR}/out"
                RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cpack failed:\n${log}")
endif()

execute_process(COMMAND dpkg --print-architecture OUTPUT_VARIABLE arch OUTPUT_STRIP_TRAILING_WHITESPACE)
set(runtime "${WORK_DIR}/out/libflashkda${ABI}_${VERSION}_${arch}.deb")
set(dev "${WORK_DIR}/out/libflashkda-dev_${VERSION}_${arch}.deb")
set(tarball "${WORK_DIR}/out/flashkda-${VERSION}-Linux.tar.gz")
foreach(file IN ITEMS "${runtime}" "${dev}" "${tarball}")
  if(NOT EXISTS "${file}")
    file(GLOB made "${WORK_DIR}/out/*")
    message(FATAL_ERROR "cpack did not write ${file}; it wrote: ${made}")
  endif()
endforeach()

# "Field: value" of a .deb's control file, as dpkg-deb -I prints it.
function(expect_field deb field expected)
  execute_process(COMMAND dpkg-deb -I "${deb}" OUTPUT_VARIABLE info RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT info MATCHES "\n ${field}: ([^\n]*)")
    message(FATAL_ERROR "dpkg-deb -I ${deb}: no ${field} field")
  endif()
  if(NOT CMAKE_MATCH_1 STREQUAL expected)
    message(FATAL_ERROR "${deb}: ${field} is '${CMAKE_MATCH_1}', expected '${expected}'")
  endif()
endfunction()
expect_field("${runtime}" Package "libflashkda${ABI}")
expect_field("${runtime}" Version "${VERSION}")
expect_field("${runtime}" Architecture "${arch}")
expect_field("${runtime}" Depends "libc6 (>= ${GLIBC_FLOOR}), libgcc-s1 | libgcc1")
expect_field("${dev}" Package "libflashkda-dev")
expect_field("${dev}" Version "${VERSION}")
expect_field("${dev}" Architecture "${arch}")
expect_field("${dev}" Depends "libflashkda${ABI} (= ${VERSION})")

# Which package holds what: a runtime package that carried the header or the
# unversioned link would clash with the next major's.
function(expect_contents deb)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "HAS;LACKS")
  execute_process(COMMAND dpkg-deb -c "${deb}" OUTPUT_VARIABLE listing RESULT_VARIABLE rc)
  foreach(path IN LISTS arg_HAS)
    string(FIND "${listing}" " ./usr/${path}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "${deb} lacks /usr/${path}:\n${listing}")
    endif()
  endforeach()
  foreach(path IN LISTS arg_LACKS)
    string(FIND "${listing}" " ./usr/${path}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${deb} holds /usr/${path}, which belongs elsewhere:\n${listing}")
    endif()
  endforeach()
endfunction()
expect_contents("${runtime}" HAS "${LIBDIR}/libflashkda.so.${VERSION}" "${LIBDIR}/libflashkda.so.${ABI} "
                LACKS "${LIBDIR}/libflashkda.so " include/)
expect_contents("${dev}" HAS include/flashkda.h "${LIBDIR}/libflashkda.so " "${LIBDIR}/pkgconfig/flashkda.pc"
                "${LIBDIR}/cmake/flashkda/flashkdaConfig.cmake"
                LACKS "${LIBDIR}/libflashkda.so.${VERSION}")

set(root "${WORK_DIR}/root")
foreach(deb IN ITEMS "${runtime}" "${dev}")
  execute_process(COMMAND dpkg-deb -x "${deb}" "${root}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "dpkg-deb -x ${deb} failed")
  endif()
endforeach()
fkda_consume("${root}/usr" "${LIBDIR}" "${WORK_DIR}/deb-consumer")

file(ARCHIVE_EXTRACT INPUT "${tarball}" DESTINATION "${WORK_DIR}/tgz")
fkda_consume("${WORK_DIR}/tgz/flashkda-${VERSION}-Linux" "${LIBDIR}" "${WORK_DIR}/tgz-consumer")
