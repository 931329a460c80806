# Installs the built library into a temporary prefix, then configures, builds
# and runs tests/consumer against that prefix only.
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install into ${prefix} failed")
endif()
foreach(required include/flashkda.h lib/libflashkda.so lib/pkgconfig/flashkda.pc
                 lib/cmake/flashkda/flashkdaConfig.cmake lib/cmake/flashkda/flashkdaConfigVersion.cmake)
  if(NOT EXISTS "${prefix}/${required}")
    message(FATAL_ERROR "installed tree lacks ${required}")
  endif()
endforeach()
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build"
                        "-DCMAKE_PREFIX_PATH=${prefix}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer against ${prefix} failed")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer failed")
endif()
execute_process(COMMAND "${WORK_DIR}/build/consumer" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the consumer failed to run against the installed library")
endif()

# The same program through pkg-config's file alone.
find_program(PKG_CONFIG pkg-config REQUIRED)
execute_process(COMMAND "${CMAKE_COMMAND}" -E env "PKG_CONFIG_PATH=${prefix}/lib/pkgconfig"
                        "${PKG_CONFIG}" --cflags --libs flashkda
                OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT flags MATCHES "-lflashkda")
  message(FATAL_ERROR "pkg-config --cflags --libs flashkda failed: '${flags}'")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
execute_process(COMMAND cc "${SOURCE_DIR}/consumer.c" ${flags} -o "${WORK_DIR}/consumer_pc"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer with pkg-config's flags failed")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" -E env "LD_LIBRARY_PATH=${prefix}/lib" "${WORK_DIR}/consumer_pc"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the pkg-config-built consumer failed to run")
endif()
