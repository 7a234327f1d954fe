#!/usr/bin/env bash
# Installs the Debian 12 (bookworm) packages kvpack's build, tests, benches and examples need,
# and only those that are missing. Idempotent: when everything is present it changes nothing and
# needs neither root nor the network.
#
#   cmake/install_deps.sh              the required packages
#   cmake/install_deps.sh --optional   also clang-format and clang-tidy (optional checks;
#                                      KVPACK_DEPS_OPTIONAL=1 does the same)
set -euo pipefail

with_optional="${KVPACK_DEPS_OPTIONAL:-0}"
for arg in "$@"; do
  case "$arg" in
    --optional) with_optional=1 ;;
    -h | --help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "install_deps: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

# Compiler and build tools; xsimd (kvpack's one library dependency); Catch2 2 (tests); Google
# Benchmark (bench/); fmt and Eigen (tests, examples and reference code); gnuplot (the Pareto
# plot compare_policies draws); clang 14 and its sanitizer runtimes (cmake/run_sanitizers.sh, part
# of the test command: ASan, UBSan, TSan); hiredis and redis-server (the Redis tier, kvpack/tier/, and
# its tests, which start their own server on loopback); ninja (the sanitizer builds: it keeps both
# cores busy where make did not, 2.5 minutes off the test command).
required=(g++ make cmake ninja-build libxsimd-dev catch2 libbenchmark-dev libfmt-dev libeigen3-dev gnuplot-nox clang-14
          libclang-rt-14-dev libhiredis-dev redis-server)
# nm (tests/package ISA symbol check) comes with binutils, a dependency of g++.
optional=(clang-format clang-tidy)

packages=("${required[@]}")
if [[ "$with_optional" != 0 ]]; then
  packages+=("${optional[@]}")
fi

# `dpkg -s` also knows removed packages whose config files remain: require "install ok installed".
is_installed() {
  dpkg -s "$1" 2>/dev/null | grep -qx 'Status: install ok installed'
}

missing=()
for package in "${packages[@]}"; do
  if is_installed "$package"; then
    echo "install_deps: $package is installed"
  else
    missing+=("$package")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install_deps: nothing to install"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_deps: missing ${missing[*]}, and apt-get is not available; install them by hand" >&2
  exit 1
fi

sudo=()
if [[ "$(id -u)" -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install_deps: missing ${missing[*]}; run as root or install sudo" >&2
    exit 1
  fi
  sudo=(sudo)
fi

echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update
"${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
echo "install_deps: installed ${missing[*]}"
