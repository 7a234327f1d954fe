# The optional CUDA backend: its tests and benches are built when nvcc is found and
# KVPACK_ENABLE_CUDA allows it. The kernels are headers (include/kvpack/kernels/cuda/); this only
# decides whether this build compiles them. Explicit architectures (Ampere 80, Hopper 90): the
# build machines have no GPU, so "native" would mean nothing there.
option(KVPACK_ENABLE_CUDA "Build the CUDA backend's tests and benches when a CUDA compiler is found" ON)
set(KVPACK_HAS_CUDA OFF)
if(KVPACK_ENABLE_CUDA)
  # Debian-style installs put nvcc outside PATH; look where NVIDIA's installer puts it.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    set(KVPACK_HAS_CUDA ON)
    message(STATUS "kvpack: CUDA backend built with ${CMAKE_CUDA_COMPILER} for architectures ${CMAKE_CUDA_ARCHITECTURES}")
  else()
    message(STATUS "kvpack: no CUDA compiler found; the CUDA backend's tests and benches are not built")
  endif()
endif()

# Flags every kvpack CUDA target uses: C++20 given directly (CMake 3.25 does not know nvcc 13's
# dialect flags, so CUDA_STANDARD 20 fails: STYLE.md §6), and constexpr host functions callable
# from device code (the page layout helpers in quant/ are shared by both sides).
function(kvpack_cuda_target target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 --expt-relaxed-constexpr -lineinfo>)
endfunction()
