# SPDX-License-Identifier: MIT
# fkda_consume(PREFIX LIBDIR WORK_DIR [SYSROOT]): configures, builds and runs
# tests/consumer against the flashkda found under PREFIX alone, once through
# its CMake package and once through pkg-config's file in LIBDIR/pkgconfig.
# SYSROOT: PREFIX lies in a scratch root whose .pc file names paths inside it
# (/usr/...), which pkg-config then resolves through PKG_CONFIG_SYSROOT_DIR.
# Included by run_consumer.cmake (an install tree) and run_packages.cmake
# (the .debs installed into a scratch root, the .tar.gz unpacked).
function(fkda_consume prefix libdir work_dir)
  set(sysroot "${ARGV3}")
  set(source_dir "${CMAKE_CURRENT_LIST_DIR}")
  foreach(required include/flashkda.h ${libdir}/libflashkda.so ${libdir}/pkgconfig/flashkda.pc
                   ${libdir}/cmake/flashkda/flashkdaConfig.cmake
                   ${libdir}/cmake/flashkda/flashkdaConfigVersion.cmake)
    if(NOT EXISTS "${prefix}/${required}")
      message(FATAL_ERROR "${prefix} lacks ${required}")
    endif()
  endforeach()
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${source_dir}" -B "${work_dir}/build"
                          "-DCMAKE_PREFIX_PATH=${prefix}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring the consumer against ${prefix} failed")
  endif()
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${work_dir}/build" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building the consumer failed")
  endif()
  execute_process(COMMAND "${work_dir}/build/consumer" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the consumer failed to run against ${prefix}")
  endif()

  find_program(PKG_CONFIG pkg-config REQUIRED)
  set(pc_env "PKG_CONFIG_PATH=${prefix}/${libdir}/pkgconfig")
  if(sysroot)
    # Only the scratch root's .pc files; /usr/include is a system directory
    # pkg-config would drop, but inside the root it must be named.
    set(pc_env "PKG_CONFIG_LIBDIR=${prefix}/${libdir}/pkgconfig" "PKG_CONFIG_SYSROOT_DIR=${sysroot}"
               PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1)
  endif()
  execute_process(COMMAND "${CMAKE_COMMAND}" -E env ${pc_env}
                          "${PKG_CONFIG}" --cflags --libs flashkda
                  OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT flags MATCHES "-lflashkda")
    message(FATAL_ERROR "pkg-config --cflags --libs flashkda failed: '${flags}'")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  execute_process(COMMAND cc "${source_dir}/consumer.c" ${flags} -o "${work_dir}/consumer_pc"
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building the consumer with pkg-config's flags failed")
  endif()
  execute_process(COMMAND "${CMAKE_COMMAND}" -E env "LD_LIBRARY_PATH=${prefix}/${libdir}" "${work_dir}/consumer_pc"
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the pkg-config-built consumer failed to run")
  endif()
endfunction()
