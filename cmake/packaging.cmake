# Packages of this build:
#   cmake --build <build> --target debs   libflashkda<ABI> and libflashkda-dev
#                                         (.deb, scripts/make-debs.sh) in <build>/debs
#   cpack (in the build folder)           flashkda-<version>-Linux.tar.gz
# scripts/dist.sh makes both and the wheel from the release build, into dist/.
#
# The .debs are assembled by scripts/make-debs.sh, not CPack's DEB generator:
# CPack writes postinst/postrm scripts that call ldconfig (Debian wants a
# trigger), counts the SONAME link's target twice in Installed-Size and has
# no place for a symbols file of its own making.

# Debian's own tools read DEBFULLNAME and DEBEMAIL; the default is a
# placeholder a distribution replaces with its maintainer.
if(DEFINED ENV{DEBEMAIL} AND DEFINED ENV{DEBFULLNAME})
  set(fkda_default_maintainer "$ENV{DEBFULLNAME} <$ENV{DEBEMAIL}>")
else()
  set(fkda_default_maintainer "libflashkda packagers <packagers@libflashkda.org>")
endif()
set(FKDA_DEB_MAINTAINER "${fkda_default_maintainer}" CACHE STRING
    "Maintainer field of the .debs and their changelog (Name <address>)")
set(FKDA_DEB_REVISION 1 CACHE STRING "Debian revision of the .debs (their version is <version>-<revision>)")
# The multiarch triplet names the library directory (/usr/lib/<triplet>), so
# that the packages of two architectures install side by side (Multi-Arch: same).
if(CMAKE_LIBRARY_ARCHITECTURE)
  set(fkda_default_multiarch ${CMAKE_LIBRARY_ARCHITECTURE})
else()
  set(fkda_default_multiarch ${CMAKE_SYSTEM_PROCESSOR}-linux-gnu)
endif()
set(FKDA_DEB_MULTIARCH ${fkda_default_multiarch} CACHE STRING
    "multiarch triplet of the .debs' library directory, /usr/lib/<triplet>")
set(FKDA_DEB_LIBDIR lib/${FKDA_DEB_MULTIARCH})
fkda_install_tree(deb_runtime deb_dev ${FKDA_DEB_LIBDIR} /usr)

set(FKDA_PACKAGE_SUMMARY "Kimi Delta Attention forward passes on NVIDIA GPUs behind a stable C ABI")
# What scripts/make-debs.sh needs to know of this configuration.
file(CONFIGURE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/debian/config.sh CONTENT [[
source_dir='@PROJECT_SOURCE_DIR@'
version='@PROJECT_VERSION@'
revision='@FKDA_DEB_REVISION@'
abi='@FKDA_ABI_VERSION@'
maintainer='@FKDA_DEB_MAINTAINER@'
libdir='@FKDA_DEB_LIBDIR@'
glibc_floor='@FKDA_GLIBC_FLOOR@'
summary='@FKDA_PACKAGE_SUMMARY@'
objcopy='@CMAKE_OBJCOPY@'
readelf='@CMAKE_READELF@'
]] @ONLY)
add_custom_target(debs
  COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/make-debs.sh ${CMAKE_CURRENT_BINARY_DIR} ${CMAKE_CURRENT_BINARY_DIR}/debs
  DEPENDS flashkda
  COMMENT "libflashkda${FKDA_ABI_VERSION} and libflashkda-dev .debs in ${CMAKE_CURRENT_BINARY_DIR}/debs"
  VERBATIM)

# `cpack`: the .tar.gz of the plain install tree (runtime and dev), for RPM
# distributions or a private prefix.
set(CPACK_GENERATOR TGZ)
set(CPACK_PACKAGE_NAME flashkda)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR libflashkda)
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${FKDA_PACKAGE_SUMMARY}")
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_ARCHIVE_COMPONENT_INSTALL OFF)
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/flashkda COMPONENT runtime)
include(CPack)
