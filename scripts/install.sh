#!/usr/bin/env bash
# Installs slotpool's C library into a prefix:
#
#   scripts/install.sh --prefix DIR [--libdir NAME] [--no-build]
#
#   DIR/include/slotpool.h
#   DIR/lib/libslotpool.so.X.Y.Z                     stripped; SONAME libslotpool.so.X
#   DIR/lib/libslotpool.so.X -> libslotpool.so.X.Y.Z   what programs load
#   DIR/lib/libslotpool.so   -> libslotpool.so.X       what -lslotpool links
#   DIR/lib/libslotpool.a                            debug info stripped
#   DIR/lib/libslotpool_preload.so                   the LD_PRELOAD library (loaded by path)
#   DIR/lib/.debug/*.debug                           debug info of both .so (gdb and perf find
#                                                    it through each library's .gnu_debuglink)
#   DIR/lib/pkgconfig/slotpool.pc                    from slotpool.pc.in
#   DIR/lib/cmake/slotpool/slotpoolConfig.cmake      imported target slotpool::slotpool
#   DIR/lib/cmake/slotpool/slotpoolConfigVersion.cmake
#
# The libraries are built with `cargo build --release` (the release profile keeps line-level
# debug info for profiling; it is split off here, so the installed .so is about 2 MB).
# --no-build installs what target/release already holds. --libdir: lib (default), lib64, ...
# Then:  PKG_CONFIG_PATH=DIR/lib/pkgconfig cc app.c $(pkg-config --cflags --libs slotpool)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

PREFIX=
LIBNAME=lib
BUILD=1
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a directory" >&2; exit 2; }
      PREFIX=$2; shift 2 ;;
    --prefix=*) PREFIX=${1#--prefix=}; shift ;;
    --libdir) [ $# -ge 2 ] || { echo "install.sh: --libdir needs a name" >&2; exit 2; }
      LIBNAME=$2; shift 2 ;;
    --libdir=*) LIBNAME=${1#--libdir=}; shift ;;
    --no-build) BUILD=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "install.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$PREFIX" ]; then
  echo "install.sh: --prefix DIR is required (see --help)" >&2
  exit 2
fi
case $LIBNAME in
  */*|.|..|'') echo "install.sh: --libdir is a directory name under the prefix, got '$LIBNAME'" >&2; exit 2 ;;
esac
for tool in objcopy strip readelf; do
  command -v "$tool" >/dev/null || { echo "install.sh: $tool (binutils) is needed" >&2; exit 1; }
done

# The version is the workspace's (Cargo.toml, [workspace.package]); the SONAME carries its major.
VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml)
MAJOR=${VERSION%%.*}
[ -n "$VERSION" ] || { echo "install.sh: no version in Cargo.toml [workspace.package]" >&2; exit 1; }

if [ "$BUILD" = 1 ]; then
  cargo build --release -p slotpool-capi -p slotpool-preload
fi
SRC=target/release
for f in libslotpool.so libslotpool.a libslotpool_preload.so; do
  [ -f "$SRC/$f" ] || { echo "install.sh: $SRC/$f missing (run without --no-build)" >&2; exit 1; }
done
SONAME=$(readelf -d "$SRC/libslotpool.so" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
if [ "$SONAME" != "libslotpool.so.$MAJOR" ]; then
  echo "install.sh: $SRC/libslotpool.so has SONAME '$SONAME', expected libslotpool.so.$MAJOR (a stale build?)" >&2
  exit 1
fi

mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
LIBDIR=$PREFIX/$LIBNAME
mkdir -p "$PREFIX/include" "$LIBDIR/.debug" "$LIBDIR/pkgconfig" "$LIBDIR/cmake/slotpool"

# A shared library: its debug info to .debug/NAME.debug, the installed copy stripped and linked
# to it by .gnu_debuglink. Written beside the target and renamed, so a running process that has
# the old file mapped keeps it.
install_shared() { # source name
  local src=$1 name=$2 tmp="$LIBDIR/.$2.tmp.$$"
  objcopy --only-keep-debug "$src" "$LIBDIR/.debug/$name.debug"
  chmod 0644 "$LIBDIR/.debug/$name.debug"
  strip --strip-debug --strip-unneeded -o "$tmp" "$src"
  (cd "$LIBDIR/.debug" && objcopy --add-gnu-debuglink="$name.debug" "$tmp")
  chmod 0755 "$tmp"
  mv -f "$tmp" "$LIBDIR/$name"
}

install -m 0644 include/slotpool.h "$PREFIX/include/slotpool.h"
install_shared "$SRC/libslotpool.so" "libslotpool.so.$VERSION"
ln -sfn "libslotpool.so.$VERSION" "$LIBDIR/libslotpool.so.$MAJOR"
ln -sfn "libslotpool.so.$MAJOR" "$LIBDIR/libslotpool.so"
# The preload library is named on LD_PRELOAD by path and never linked against: one unversioned
# file, beside libslotpool.so.$MAJOR, which it opens from its own directory.
install_shared "$SRC/libslotpool_preload.so" libslotpool_preload.so
strip --strip-debug -o "$LIBDIR/.libslotpool.a.tmp.$$" "$SRC/libslotpool.a"
chmod 0644 "$LIBDIR/.libslotpool.a.tmp.$$"
mv -f "$LIBDIR/.libslotpool.a.tmp.$$" "$LIBDIR/libslotpool.a"

subst() { # template output
  sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@LIBDIR@|$LIBDIR|g" -e "s|@LIBDIR_REL@|$LIBNAME|g" \
    -e "s|@VERSION@|$VERSION|g" -e "s|@MAJOR@|$MAJOR|g" -e "s|@CMAKE_TO_PREFIX@|../../..|g" \
    "$1" >"$2"
}
subst slotpool.pc.in "$LIBDIR/pkgconfig/slotpool.pc"
subst cmake/slotpoolConfig.cmake.in "$LIBDIR/cmake/slotpool/slotpoolConfig.cmake"
subst cmake/slotpoolConfigVersion.cmake.in "$LIBDIR/cmake/slotpool/slotpoolConfigVersion.cmake"

echo "installed slotpool $VERSION into $PREFIX:"
(cd "$LIBDIR" && ls -l libslotpool* | sed 's/^[^ ]* *[0-9]* [^ ]* *[^ ]* */  /')
echo "build a program with:"
echo "  PKG_CONFIG_PATH=$LIBDIR/pkgconfig cc app.c \$(pkg-config --cflags --libs slotpool)"
