# SPDX-License-Identifier: MIT
# Packages of this build:
#   cmake --build <build> --target debs   libflashkda<ABI> and libflashkda-dev
#                                         (scripts/make-debs.sh) in <build>/packages
#   cmake --build <build> --target tgz    flashkda-<version>-Linux.tar.gz
#                                         (scripts/make-tgz.sh) in <build>/packages
# scripts/dist.sh makes them and the wheel from the release build, into dist/.
#
# No CPack: its DEB generator writes postinst/postrm scripts that call
# ldconfig (Debian wants a trigger), counts the SONAME link's target twice in
# Installed-Size and has no place for a symbols file of our making; and every
# cpack run builds all targets first (its preinstall step), tests included.

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
# What scripts/make-debs.sh and scripts/make-tgz.sh need to know of this configuration.
file(CONFIGURE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/packaging/config.sh CONTENT [[
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
  COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/make-debs.sh ${CMAKE_CURRENT_BINARY_DIR} ${CMAKE_CURRENT_BINARY_DIR}/packages
  DEPENDS flashkda
  COMMENT "libflashkda${FKDA_ABI_VERSION} and libflashkda-dev .debs in ${CMAKE_CURRENT_BINARY_DIR}/packages"
  VERBATIM)
add_custom_target(tgz
  COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/make-tgz.sh ${CMAKE_CURRENT_BINARY_DIR} ${CMAKE_CURRENT_BINARY_DIR}/packages
  DEPENDS flashkda
  COMMENT "flashkda-${PROJECT_VERSION}-Linux.tar.gz in ${CMAKE_CURRENT_BINARY_DIR}/packages"
  VERBATIM)
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/flashkda COMPONENT runtime)
