# SPDX-License-Identifier: MIT
# The packages of the build: the .debs of scripts/make-debs.sh (fields,
# contents, control files, the stripped library and its debug file), installed
# with dpkg into a scratch root where tests/consumer is built through
# find_package and pkg-config; then scripts/make-tgz.sh's .tar.gz, unpacked
# and consumed likewise.
cmake_policy(VERSION 3.24)
include("${CMAKE_CURRENT_LIST_DIR}/consume.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")
set(out "${WORK_DIR}/out")
execute_process(COMMAND bash "${SOURCE_DIR}/scripts/make-debs.sh" "${BUILD_DIR}" "${out}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "make-debs.sh failed:\n${log}")
endif()
execute_process(COMMAND bash "${SOURCE_DIR}/scripts/make-tgz.sh" "${BUILD_DIR}" "${out}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "make-tgz.sh failed:\n${log}")
endif()

execute_process(COMMAND dpkg --print-architecture OUTPUT_VARIABLE arch OUTPUT_STRIP_TRAILING_WHITESPACE)
set(deb_version "${VERSION}-${DEB_REVISION}")
set(runtime_name "libflashkda${ABI}")
set(runtime "${out}/${runtime_name}_${deb_version}_${arch}.deb")
set(dev "${out}/libflashkda-dev_${deb_version}_${arch}.deb")
set(tarball "${out}/flashkda-${VERSION}-Linux.tar.gz")
set(debug_file "${out}/libflashkda.so.${VERSION}.debug")
foreach(file IN ITEMS "${runtime}" "${dev}" "${tarball}" "${debug_file}")
  if(NOT EXISTS "${file}")
    file(GLOB made "${out}/*")
    message(FATAL_ERROR "no ${file}; made: ${made}")
  endif()
endforeach()

# "Field: value" of a .deb's control file, as dpkg-deb -I prints it.
function(expect_field deb field expected)
  execute_process(COMMAND dpkg-deb -f "${deb}" "${field}" OUTPUT_VARIABLE value
                  OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT value STREQUAL expected)
    message(FATAL_ERROR "${deb}: ${field} is '${value}', expected '${expected}'")
  endif()
endfunction()
foreach(deb IN ITEMS "${runtime}" "${dev}")
  expect_field("${deb}" Version "${deb_version}")
  expect_field("${deb}" Architecture "${arch}")
  expect_field("${deb}" Multi-Arch same)
  expect_field("${deb}" Maintainer "${MAINTAINER}")
endforeach()
expect_field("${runtime}" Package "${runtime_name}")
expect_field("${runtime}" Section libs)
expect_field("${runtime}" Depends "libc6 (>= ${GLIBC_FLOOR}), libgcc-s1 | libgcc1")
expect_field("${dev}" Package "libflashkda-dev")
expect_field("${dev}" Section libdevel)
expect_field("${dev}" Depends "${runtime_name} (= ${deb_version})")

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
expect_contents("${runtime}" HAS "${DEB_LIBDIR}/libflashkda.so.${VERSION}" "${DEB_LIBDIR}/libflashkda.so.${ABI} "
                "share/doc/${runtime_name}/copyright" "share/doc/${runtime_name}/changelog.Debian.gz"
                LACKS "${DEB_LIBDIR}/libflashkda.so " include/ "lib/libflashkda")
expect_contents("${dev}" HAS include/flashkda.h "${DEB_LIBDIR}/libflashkda.so " "${DEB_LIBDIR}/pkgconfig/flashkda.pc"
                "${DEB_LIBDIR}/cmake/flashkda/flashkdaConfig.cmake"
                "share/doc/libflashkda-dev/copyright" "share/doc/libflashkda-dev/changelog.Debian.gz"
                LACKS "${DEB_LIBDIR}/libflashkda.so.${VERSION}")

# The runtime's control files: a symbols file naming the library's exports,
# the ldconfig trigger, and no maintainer script.
set(control "${WORK_DIR}/control")
execute_process(COMMAND dpkg-deb -e "${runtime}" "${control}" RESULT_VARIABLE rc)
file(GLOB control_files RELATIVE "${control}" "${control}/*")
list(SORT control_files)
if(NOT control_files STREQUAL "control;md5sums;shlibs;symbols;triggers")
  message(FATAL_ERROR "${runtime}: control files ${control_files}")
endif()
file(READ "${control}/triggers" triggers)
if(NOT triggers STREQUAL "activate-noawait ldconfig\n")
  message(FATAL_ERROR "${runtime}: triggers file '${triggers}'")
endif()
file(STRINGS "${control}/symbols" symbols)
list(POP_FRONT symbols symbols_head symbols_field)
if(NOT symbols_head STREQUAL "libflashkda.so.${ABI} ${runtime_name} #MINVER#"
   OR NOT symbols_field STREQUAL "* Build-Depends-Package: libflashkda-dev")
  message(FATAL_ERROR "${runtime}: symbols file starts with '${symbols_head}', '${symbols_field}'")
endif()
execute_process(COMMAND readelf --dyn-syms --wide "${BUILD_DIR}/libflashkda.so.${ABI}" OUTPUT_VARIABLE exports)
string(REGEX MATCHALL "fkda_[a-z0-9_]+@@FLASHKDA_${ABI}" exported "${exports}")
list(LENGTH exported export_count)
set(listed_count 0)
foreach(line IN LISTS symbols)
  if(line MATCHES "^ (fkda_[a-z0-9_]+)@FLASHKDA_${ABI} ${VERSION}$")
    if(NOT "${CMAKE_MATCH_1}@@FLASHKDA_${ABI}" IN_LIST exported)
      message(FATAL_ERROR "${runtime}: the symbols file lists ${CMAKE_MATCH_1}, which the library does not export")
    endif()
    math(EXPR listed_count "${listed_count} + 1")
  elseif(NOT line STREQUAL " FLASHKDA_${ABI}@FLASHKDA_${ABI} ${VERSION}")
    message(FATAL_ERROR "${runtime}: symbols line '${line}'")
  endif()
endforeach()
if(export_count EQUAL 0 OR NOT listed_count EQUAL export_count)
  message(FATAL_ERROR "${runtime}: the symbols file lists ${listed_count} functions, the library exports ${export_count}")
endif()

# Installed-Size (KiB) against what the files take: at least their size,
# and not the double that a link counted as its target gives.
execute_process(COMMAND dpkg-deb -f "${runtime}" Installed-Size OUTPUT_VARIABLE installed_size
                OUTPUT_STRIP_TRAILING_WHITESPACE)
set(extracted "${WORK_DIR}/runtime-files")
execute_process(COMMAND dpkg-deb -x "${runtime}" "${extracted}")
file(GLOB_RECURSE runtime_files LIST_DIRECTORIES false "${extracted}/*")
set(bytes 0)
foreach(file IN LISTS runtime_files)
  if(NOT IS_SYMLINK "${file}")
    file(SIZE "${file}" size)
    math(EXPR bytes "${bytes} + ${size}")
  endif()
endforeach()
math(EXPR real_kib "(${bytes} + 1023) / 1024")
math(EXPR ceiling_kib "${real_kib} + ${real_kib} / 20 + 64")
if(installed_size LESS real_kib OR installed_size GREATER ceiling_kib)
  message(FATAL_ERROR "${runtime}: Installed-Size ${installed_size} KiB, the files take ${real_kib} KiB")
endif()

# The shipped library is stripped and points at its debug file, which holds
# the symbol table.
set(shipped "${extracted}/usr/${DEB_LIBDIR}/libflashkda.so.${VERSION}")
execute_process(COMMAND readelf -S --wide "${shipped}" OUTPUT_VARIABLE sections)
if(sections MATCHES "\\.symtab" OR NOT sections MATCHES "\\.gnu_debuglink")
  message(FATAL_ERROR "${shipped}: expected no .symtab and a .gnu_debuglink:\n${sections}")
endif()
execute_process(COMMAND readelf -S --wide "${debug_file}" OUTPUT_VARIABLE sections)
if(NOT sections MATCHES "\\.symtab")
  message(FATAL_ERROR "${debug_file} holds no symbol table")
endif()

# Both .debs installed by dpkg itself into a scratch root (its own database;
# libc6 and libgcc-s1 are the host's, hence --force-depends).
set(root "${WORK_DIR}/root")
file(MAKE_DIRECTORY "${root}/var/lib/dpkg/info" "${root}/var/lib/dpkg/updates" "${root}/var/log")
file(TOUCH "${root}/var/lib/dpkg/status")
execute_process(COMMAND dpkg --root=${root} --log=${WORK_DIR}/dpkg.log --force-not-root --force-depends
                        --force-unsafe-io -i "${runtime}" "${dev}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "dpkg --root=${root} -i failed:\n${log}")
endif()
foreach(package IN ITEMS "${runtime_name}" libflashkda-dev)
  execute_process(COMMAND dpkg-query --admindir=${root}/var/lib/dpkg -W -f=\${Status} ${package}
                  OUTPUT_VARIABLE status)
  if(NOT status STREQUAL "install ok installed")
    message(FATAL_ERROR "${package} in ${root}: '${status}'")
  endif()
endforeach()

# The system .pc file names /usr/include as it is, so pkg-config drops it as
# a system directory.
find_program(PKG_CONFIG pkg-config REQUIRED)
foreach(query IN ITEMS --cflags --variable=includedir)
  execute_process(COMMAND "${CMAKE_COMMAND}" -E env "PKG_CONFIG_LIBDIR=${root}/usr/${DEB_LIBDIR}/pkgconfig"
                          "${PKG_CONFIG}" ${query} flashkda
                  OUTPUT_VARIABLE pc_${query} OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config ${query} flashkda failed in ${root}")
  endif()
endforeach()
if(NOT pc_--cflags STREQUAL "" OR NOT pc_--variable=includedir STREQUAL "/usr/include")
  message(FATAL_ERROR "the .deb's flashkda.pc: --cflags '${pc_--cflags}' (expected nothing), "
                      "includedir '${pc_--variable=includedir}' (expected /usr/include)")
endif()
fkda_consume("${root}/usr" "${DEB_LIBDIR}" "${WORK_DIR}/deb-consumer" "${root}")

file(ARCHIVE_EXTRACT INPUT "${tarball}" DESTINATION "${WORK_DIR}/tgz")
set(tree "${WORK_DIR}/tgz/flashkda-${VERSION}-Linux")
if(NOT EXISTS "${tree}/share/doc/flashkda/LICENSE")
  message(FATAL_ERROR "${tarball} lacks share/doc/flashkda/LICENSE")
endif()
fkda_consume("${tree}" "${LIBDIR}" "${WORK_DIR}/tgz-consumer")
