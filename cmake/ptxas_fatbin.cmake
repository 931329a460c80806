# SPDX-License-Identifier: MIT
# The kernels' fatbin from three tools instead of one nvcc: NVCC's front end
# writes PTX, PTXAS (of another CUDA release) assembles the machine code, and
# FATBINARY packs it. This is how a build gets machine code of a CUDA 12
# ptxas, which every CUDA 12 driver loads, where only a newer nvcc is at hand
# (PyPI's nvidia-cuda-nvcc-cu12 ships ptxas but no nvcc).
#
# The PTX is declared at PTX_ISA, the newest ISA that PTXAS knows; PTXAS
# rejects the file if the kernels use anything beyond it.
#
# cmake -DNVCC= -DPTXAS= -DFATBINARY= -DPTX_ISA= -DARCHS="sm_80 ..."
#       -DFRONT_FLAGS="..." -DPTXAS_FLAGS="..." -DSOURCE= -DINCLUDE_DIR=
#       -DWORK_DIR= -DOUTPUT= -P ptxas_fatbin.cmake
separate_arguments(archs UNIX_COMMAND "${ARCHS}")
separate_arguments(front_flags UNIX_COMMAND "${FRONT_FLAGS}")
separate_arguments(ptxas_flags UNIX_COMMAND "${PTXAS_FLAGS}")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${command}")
  endif()
endfunction()

set(images)
foreach(arch IN LISTS archs)
  string(REGEX REPLACE "^(sm|compute)_" "" number "${arch}")
  set(ptx "${WORK_DIR}/compute_${number}.ptx")
  run("${NVCC}" -ptx -arch=compute_${number} ${front_flags} "-I${INCLUDE_DIR}" -o "${ptx}" "${SOURCE}")
  file(READ "${ptx}" text)
  string(REGEX REPLACE "\n\\.version [0-9]+\\.[0-9]+\n" "\n.version ${PTX_ISA}\n" text "${text}")
  file(WRITE "${ptx}" "${text}")
  if(arch MATCHES "^sm_")
    set(cubin "${WORK_DIR}/${arch}.cubin")
    run("${PTXAS}" -arch=${arch} ${ptxas_flags} -o "${cubin}" "${ptx}")
    list(APPEND images "--image3=kind=elf,sm=${number},file=${cubin}")
  else()
    list(APPEND images "--image3=kind=ptx,sm=${number},file=${ptx}")
  endif()
endforeach()
# Uncompressed: older drivers may not read the newer compression formats.
run("${FATBINARY}" -64 --compress-mode=none "--create=${OUTPUT}" ${images})
file(REMOVE_RECURSE "${WORK_DIR}")
