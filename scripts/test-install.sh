#!/usr/bin/env bash
# scripts/install.sh into a temporary prefix, then what a user does with it: build a C program
# with `pkg-config --cflags --libs slotpool` (and with CMake's find_package where cmake exists)
# and run it on the simulated device. Part of scripts/test.sh.
#
#   scripts/test-install.sh [--no-build]     (--no-build: install what target/release holds)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
fail() { echo "test-install: FAILED: $*" >&2; exit 1; }

if ! command -v pkg-config >/dev/null; then
  # CI runs as root on Debian with its package archive reachable.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test-install: installing pkg-config with apt-get"
    apt-get update -qq >/dev/null && apt-get install -y -qq pkg-config >/dev/null
  fi
  command -v pkg-config >/dev/null || fail "pkg-config is not installed (apt-get install pkg-config)"
fi
CC=${CC:-cc}
command -v "$CC" >/dev/null || fail "no C compiler ($CC)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/slotpool-install.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PREFIX=$WORK/prefix

# Bad arguments are refused with a message and install nothing.
if out=$(scripts/install.sh 2>&1); then fail "install.sh without --prefix succeeded"; fi
[[ $out == *"--prefix DIR is required"* ]] || fail "install.sh without --prefix said: $out"
if out=$(scripts/install.sh --prefix "$PREFIX" --bogus 2>&1); then fail "an unknown flag was accepted"; fi
[[ $out == *"unknown argument '--bogus'"* ]] || fail "install.sh --bogus said: $out"
[ ! -e "$PREFIX" ] || fail "a refused install created $PREFIX"

scripts/install.sh --prefix "$PREFIX" "$@" >"$WORK/install.log" 2>&1 || {
  cat "$WORK/install.log"
  fail "scripts/install.sh --prefix $PREFIX"
}
LIB=$PREFIX/lib
VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml)
MAJOR=${VERSION%%.*}

# The layout: a versioned file, its SONAME link and the development link.
[ -f "$LIB/libslotpool.so.$VERSION" ] && [ ! -L "$LIB/libslotpool.so.$VERSION" ] ||
  fail "no libslotpool.so.$VERSION file"
[ "$(readlink "$LIB/libslotpool.so.$MAJOR")" = "libslotpool.so.$VERSION" ] || fail "libslotpool.so.$MAJOR link"
[ "$(readlink "$LIB/libslotpool.so")" = "libslotpool.so.$MAJOR" ] || fail "libslotpool.so link"
readelf -d "$LIB/libslotpool.so.$VERSION" | grep -q "Library soname: \[libslotpool.so.$MAJOR\]" ||
  fail "the installed library's SONAME is not libslotpool.so.$MAJOR"
for f in include/slotpool.h lib/libslotpool.a lib/libslotpool_preload.so lib/pkgconfig/slotpool.pc \
  lib/cmake/slotpool/slotpoolConfig.cmake lib/cmake/slotpool/slotpoolConfigVersion.cmake; do
  [ -f "$PREFIX/$f" ] || fail "$f not installed"
done
cmp -s include/slotpool.h "$PREFIX/include/slotpool.h" || fail "the installed header differs"
# Shipped stripped, the debug info beside it in .debug/ (reached through .gnu_debuglink).
for so in "libslotpool.so.$VERSION" libslotpool_preload.so; do
  size=$(stat -c %s "$LIB/$so")
  [ "$size" -lt $((4 << 20)) ] || fail "$so is $size bytes: not stripped?"
  if readelf -S "$LIB/$so" | grep -q '\.debug_info'; then fail "$so still has .debug_info"; fi
  readelf -S "$LIB/$so" | grep -q '\.gnu_debuglink' || fail "$so has no .gnu_debuglink"
  readelf -S "$LIB/.debug/$so.debug" | grep -q '\.debug_info' || fail ".debug/$so.debug has no debug info"
done
# Stripping kept every exported function.
exports() { nm -D --defined-only "$1" | awk '$2 == "T" {print $3}' | sort; }
if command -v nm >/dev/null; then
  [ "$(exports target/release/libslotpool.so)" = "$(exports "$LIB/libslotpool.so.$VERSION")" ] ||
    fail "the installed library exports other functions than the built one"
  exports "$LIB/libslotpool.so.$VERSION" | grep -qx sp_status_name || fail "sp_status_name not exported"
fi
echo "test-install: layout ok ($(stat -c %s "$LIB/libslotpool.so.$VERSION") bytes, SONAME libslotpool.so.$MAJOR)"

# pkg-config, as the user runs it.
export PKG_CONFIG_PATH=$LIB/pkgconfig
[ "$(pkg-config --modversion slotpool)" = "$VERSION" ] || fail "pkg-config --modversion slotpool"
# shellcheck disable=SC2046 # word splitting of pkg-config's flags is the point
"$CC" -std=c11 -Wall -Wextra -Werror tests/c/installed.c -o "$WORK/installed" \
  $(pkg-config --cflags --libs slotpool) || fail "cc installed.c \$(pkg-config --cflags --libs slotpool)"
readelf -d "$WORK/installed" | grep -q "Shared library: \[libslotpool.so.$MAJOR\]" ||
  fail "the program does not record libslotpool.so.$MAJOR"
out=$(cd "$WORK" && env -u SLOTPOOL_CONF LD_LIBRARY_PATH="$LIB" SLOTPOOL_BACKEND=sim ./installed) ||
  fail "the program built with pkg-config: $out"
[[ $out == "installed: ok, slotpool $VERSION, a double free is SP_ERR_UNKNOWN_POINTER" ]] || fail "output: $out"
echo "test-install: pkg-config build ok: $out"

# A log read through a pipe is plain text: no ANSI escape codes.
log=$(cd "$WORK" && LD_LIBRARY_PATH="$LIB" SLOTPOOL_BACKEND=sim SLOTPOOL_LOG=debug ./installed 2>&1 >/dev/null | cat)
[[ $log == *"slotpool initialised"* ]] || fail "SLOTPOOL_LOG=debug logged nothing: $log"
if [[ $log == *$'\e'* ]]; then fail "escape codes in a piped log: $(printf %q "$log")"; fi
echo "test-install: piped log has no escape codes"

# --libdir: the same layout under lib64, and a .pc that points there.
scripts/install.sh --prefix "$WORK/p64" --libdir lib64 --no-build >/dev/null || fail "install.sh --libdir lib64"
[ -L "$WORK/p64/lib64/libslotpool.so.$MAJOR" ] && [ ! -e "$WORK/p64/lib" ] || fail "--libdir lib64 layout"
[ "$(PKG_CONFIG_PATH=$WORK/p64/lib64/pkgconfig pkg-config --variable=libdir slotpool)" = "$WORK/p64/lib64" ] ||
  fail "slotpool.pc of --libdir lib64"
grep -q '/lib64/libslotpool.so' "$WORK/p64/lib64/cmake/slotpool/slotpoolConfig.cmake" || fail "cmake config of --libdir lib64"

if command -v cmake >/dev/null; then
  mkdir -p "$WORK/cmake-app"
  cp tests/c/installed.c "$WORK/cmake-app/"
  cat >"$WORK/cmake-app/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(installed C)
find_package(slotpool $MAJOR CONFIG REQUIRED)
add_executable(installed installed.c)
target_link_libraries(installed PRIVATE slotpool::slotpool)
CMAKE
  cmake -S "$WORK/cmake-app" -B "$WORK/cmake-build" -DCMAKE_PREFIX_PATH="$PREFIX" >"$WORK/cmake.log" 2>&1 &&
    cmake --build "$WORK/cmake-build" >>"$WORK/cmake.log" 2>&1 || { cat "$WORK/cmake.log"; fail "cmake build"; }
  out=$(SLOTPOOL_BACKEND=sim "$WORK/cmake-build/installed") || fail "the program built with cmake: $out"
  [[ $out == "installed: ok, slotpool $VERSION,"* ]] || fail "cmake program output: $out"
  # A newer major version is not this package.
  sed -i "s/find_package(slotpool $MAJOR /find_package(slotpool $((MAJOR + 1)) /" "$WORK/cmake-app/CMakeLists.txt"
  if cmake -S "$WORK/cmake-app" -B "$WORK/cmake-build2" -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null 2>&1; then
    fail "find_package(slotpool $((MAJOR + 1))) accepted version $VERSION"
  fi
  echo "test-install: cmake find_package build ok"
else
  echo "test-install: SKIPPED the CMake check: cmake is not installed"
fi
echo "test-install: ok"
