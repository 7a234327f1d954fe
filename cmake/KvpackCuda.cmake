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
    find_package(CUDAToolkit REQUIRED)  # CUDA::cudart_static, for kvpack::cuda's consumers
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

# kvpack_add_cuda_library(<target>): a static library with the CUDA backend's entry points
# (kvpack/backend/cuda_api.hpp) compiled by nvcc, so that code built by any C++ compiler can call
# them. Linking it defines KVPACK_HAS_CUDA=1 for the consumer: kvpack/dispatch.hpp then sends
# launches over device memory to it.
function(kvpack_add_cuda_library target)
  add_library(${target} STATIC "${PROJECT_SOURCE_DIR}/cmake/kvpack_cuda_library.cu")
  target_link_libraries(${target} PUBLIC kvpack CUDA::cudart_static)
  target_compile_definitions(${target} INTERFACE KVPACK_HAS_CUDA=1)
  kvpack_cuda_target(${target})
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()
