#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Assembles libflashkda<ABI> and libflashkda-dev (.deb) from a configured and
# built tree's deb_runtime and deb_dev install components:
#
#   scripts/make-debs.sh BUILD_DIR OUT_DIR      (or: cmake --build BUILD_DIR --target debs)
#
# Writes OUT_DIR/libflashkda<ABI>_<version>-<rev>_<arch>.deb, the -dev .deb and
# libflashkda.so.<version>.debug: the debug information (symbol table) that
# the shipped library is stripped of, found by gdb through its build ID or
# its .gnu_debuglink. Needs dpkg-deb, objcopy, readelf and gzip.
set -euo pipefail
build=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
# shellcheck source=/dev/null
source "$build/packaging/config.sh"
arch=$(dpkg --print-architecture)
deb_version="$version-$revision"
runtime=libflashkda$abi
dev=libflashkda-dev
# A staging folder per run: the packages and lintian tests may run at once.
work=$(mktemp -d "$build/packaging/debs-XXXXXX")
trap 'rm -rf "$work"' EXIT
# Debian's modes whatever the caller's umask: 0755 directories, 0644 files.
umask 022

stage() { # component package
  local root="$work/$2"
  DESTDIR="$root" cmake --install "$build" --prefix /usr --component "$1" >/dev/null
  find "$root" -type d -exec chmod 0755 {} +
  # A shared library is not a program: Debian ships it without the x bit.
  find "$root" -type f -exec chmod 0644 {} +
}
stage deb_runtime "$runtime"
stage deb_dev "$dev"

library="$work/$runtime/usr/$libdir/libflashkda.so.$version"
[ -f "$library" ] || { echo "make-debs: $library was not installed" >&2; exit 1; }
debug_file="$out/libflashkda.so.$version.debug"
"$objcopy" --only-keep-debug "$library" "$debug_file"
chmod 0644 "$debug_file"
# What dh_strip does to a shared library; the build ID note stays.
"$objcopy" --strip-unneeded --remove-section=.comment --remove-section=.note "$library"
"$objcopy" --add-gnu-debuglink="$debug_file" "$library"

# The changelog's date: the last commit's, or SOURCE_DATE_EPOCH for a
# reproducible build.
changelog_epoch=${SOURCE_DATE_EPOCH:-$(git -C "$source_dir" log -1 --format=%ct 2>/dev/null || date +%s)}
changelog_date=$(date -u -R -d "@$changelog_epoch")

# The section of CHANGELOG.md for this version as one Debian changelog entry:
# each "### Kind" a "[ Kind ]" line, each bullet a "*" item re-wrapped to 78
# columns (lintian wants at most 80).
debian_changelog() {
  echo "libflashkda ($deb_version) unstable; urgency=medium"
  echo
  # This version's section, or the newest one when none names this version yet.
  local has_version=0
  grep -Eq "^## $version( |\$)" "$source_dir/CHANGELOG.md" && has_version=1
  awk -v version="$version" -v has_version="$has_version" '
    function flush() { if (item != "") { print item; item = "" } }
    /^## / { flush(); sections++
             inside = (index($0, "## " version " ") == 1 || $0 == "## " version || (sections == 1 && !has_version))
             next }
    !inside { next }
    /^### / { flush(); sub(/^### /, ""); print "\001[ " $0 " ]"; next }
    /^- / { flush(); item = substr($0, 3); next }
    /^  +[^ ]/ && item != "" { line = $0; sub(/^ +/, "", line); item = item " " line; next }
    /^$/ { flush(); next }
    END { flush() }
  ' "$source_dir/CHANGELOG.md" | while IFS= read -r paragraph; do
    if [[ $paragraph == $'\001'* ]]; then
      echo "  ${paragraph#?}"
    else
      fold -s -w 74 <<<"$paragraph" | sed -e 's/ *$//' -e '1s/^/  * /' -e '2,$s/^/    /'
    fi
  done
  echo
  echo " -- $maintainer  $changelog_date"
}

# From the first commit's year to the changelog's, where git knows them.
changelog_year=$(date -u -d "@$changelog_epoch" +%Y)
# (tail reads the whole log: a reader that stops early would make git die of SIGPIPE.)
first_year=$(git -C "$source_dir" log --format=%cd --date=format:%Y 2>/dev/null | tail -n 1 || true)
copyright_years=${first_year:-$changelog_year}
[ "$copyright_years" = "$changelog_year" ] || copyright_years="$copyright_years-$changelog_year"

copyright() {
  cat <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: libflashkda
Upstream-Contact: $maintainer

Files: *
Copyright: $copyright_years the libflashkda authors
License: MIT

License: MIT
EOF
  # The licence text below its header, blank lines as " ." (DEP-5).
  sed -n '/^Permission is hereby granted/,$p' "$source_dir/LICENSE" | sed -e 's/^$/./' -e 's/^/ /'
}

docs() { # package
  local doc="$work/$1/usr/share/doc/$1"
  mkdir -p "$doc"
  copyright >"$doc/copyright"
  debian_changelog | gzip -9n >"$doc/changelog.Debian.gz"
  gzip -9nc "$source_dir/CHANGELOG.md" >"$doc/changelog.gz"
  local overrides="$source_dir/cmake/debian/$2.lintian-overrides"
  if [ -f "$overrides" ]; then
    mkdir -p "$work/$1/usr/share/lintian/overrides"
    sed "s/@PACKAGE@/$1/g" "$overrides" >"$work/$1/usr/share/lintian/overrides/$1"
  fi
  chmod 0644 "$doc"/* 
}
docs "$runtime" runtime
docs "$dev" dev

# dpkg-gencontrol's count: every file rounded up to a KiB, one KiB for each
# other entry (directory, link).
installed_size() {
  find "$1" -mindepth 1 -not -path "$1/DEBIAN*" -printf '%y %s\n' |
    awk '{ total += ($1 == "f") ? int(($2 + 1023) / 1024) : 1 } END { print total }'
}

control() { # package section multi-arch depends description...
  local root="$work/$1"
  mkdir -p "$root/DEBIAN"
  {
    echo "Package: $1"
    echo "Source: libflashkda"
    echo "Version: $deb_version"
    echo "Architecture: $arch"
    echo "Multi-Arch: same"
    echo "Maintainer: $maintainer"
    echo "Installed-Size: $(installed_size "$root")"
    echo "Depends: $3"
    echo "Section: $2"
    echo "Priority: optional"
    echo "Description: $summary"
    shift 3
    printf ' %s\n' "$@"
  } >"$root/DEBIAN/control"
  (cd "$root" && find usr -type f -print0 | sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
}

control "$runtime" libs "libc6 (>= $glibc_floor), libgcc-s1 | libgcc1" \
  "libflashkda.so.$abi: kernels for sm_80 and sm_90 embedded in one shared" \
  "library that finds the CUDA driver at run time, plus a CPU reference" \
  "backend."
control "$dev" libdevel "$runtime (= $deb_version)" \
  "Development files: flashkda.h, the libflashkda.so link, the CMake package" \
  "(find_package(flashkda)) and flashkda.pc for pkg-config."

# The runtime's library interface: a symbols file listing what the library
# exports (read from the library, so that it follows cmake/flashkda.map and
# the header), a shlibs file for older tools, and the ldconfig trigger.
control_dir="$work/$runtime/DEBIAN"
{
  echo "libflashkda.so.$abi $runtime #MINVER#"
  echo "* Build-Depends-Package: $dev"
  "$readelf" --dyn-syms --wide "$library" |
    awk -v version="$version" '$7 != "UND" && $8 ~ /@/ { sub(/@@/, "@", $8); print " " $8 " " version }' |
    sort -u
} >"$control_dir/symbols"
grep -q ' fkda_' "$control_dir/symbols" || { echo "make-debs: no fkda_ export in $library" >&2; exit 1; }
echo "libflashkda $abi $runtime (>= $version)" >"$control_dir/shlibs"
echo "activate-noawait ldconfig" >"$control_dir/triggers"
chmod 0644 "$control_dir"/* "$work/$dev/DEBIAN"/*

for package in "$runtime" "$dev"; do
  dpkg-deb --root-owner-group -Zxz --build "$work/$package" "$out/${package}_${deb_version}_${arch}.deb" >/dev/null
  echo "$out/${package}_${deb_version}_${arch}.deb"
done
echo "$debug_file"
