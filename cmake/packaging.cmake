# `cpack` in the build folder: libflashkda0 and libflashkda-dev as .debs (one
# per install component) and a .tar.gz of the whole install tree.
set(CPACK_GENERATOR "DEB;TGZ")
set(CPACK_PACKAGE_NAME flashkda)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR libflashkda)
set(CPACK_PACKAGE_CONTACT "libflashkda maintainers <libflashkda@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Kimi Delta Attention forward passes on NVIDIA GPUs behind a stable C ABI")
set(CPACK_PACKAGE_HOMEPAGE_URL "")
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_ARCHIVE_COMPONENT_INSTALL OFF)

# DEB installs under /usr (its default prefix); the archive holds a bare tree.
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libflashkda${FKDA_ABI_VERSION})
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
# The glibc floor the library is held to; libgcc_s for the unwinder (its
# package is libgcc1 before Debian 11 and Ubuntu 20.04). No CUDA package:
# the driver is found at run time, and CPU plans need none.
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "libc6 (>= ${FKDA_GLIBC_FLOOR}), libgcc-s1 | libgcc1")
set(CPACK_COMPONENT_RUNTIME_DESCRIPTION "libflashkda.so.${FKDA_ABI_VERSION}: kernels for sm_80 and sm_90 embedded in one shared
library that finds the CUDA driver at run time, plus a CPU reference backend.")
# A shlibs file for packages linking against it, and the ldconfig trigger.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_DEV_PACKAGE_NAME libflashkda-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libflashkda${FKDA_ABI_VERSION} (= ${PROJECT_VERSION})")
set(CPACK_COMPONENT_DEV_DESCRIPTION "Development files: flashkda.h, the libflashkda.so link, the CMake
package (find_package(flashkda)) and flashkda.pc for pkg-config.")
include(CPack)
