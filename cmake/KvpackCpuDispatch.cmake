# kvpack_add_cpu_dispatch_library(<target>): a static library with every precompiled CPU kernel
# (kvpack/kernels/cpu/precompiled.hpp) compiled once per instruction set, each translation unit
# with its own -m flags and nothing global (a global -march would leak wide instructions into
# code every CPU runs). Linking it defines KVPACK_HAS_CPU_DISPATCH=1 for the consumer, which
# then picks the best set at run time (kvpack/dispatch.hpp).
include_guard(GLOBAL)

set(KVPACK_CPU_ISAS avx512 avx2 sse2)
set(KVPACK_CPU_ARCH_avx512 "xsimd::avx512bw")
set(KVPACK_CPU_FLAGS_avx512 -mavx512f -mavx512cd -mavx512dq -mavx512bw -mavx512vl -mavx512vnni
    -mavx2 -mfma -mf16c)
set(KVPACK_CPU_ARCH_avx2 "xsimd::fma3<xsimd::avx2>")
set(KVPACK_CPU_FLAGS_avx2 -mavx2 -mfma -mf16c)
set(KVPACK_CPU_ARCH_sse2 "xsimd::sse2")
set(KVPACK_CPU_FLAGS_sse2 "")

function(kvpack_add_cpu_dispatch_library target)
  set(generated_dir "${CMAKE_CURRENT_BINARY_DIR}/${target}_generated")
  set(sources "")
  foreach(isa IN LISTS KVPACK_CPU_ISAS)
    set(KVPACK_ISA_NAME "${isa}")
    set(KVPACK_ISA_ARCH "${KVPACK_CPU_ARCH_${isa}}")
    set(source "${generated_dir}/instantiate_${isa}.cpp")
    configure_file("${PROJECT_SOURCE_DIR}/cmake/kvpack_instantiate.cpp.in" "${source}" @ONLY)
    # -O2 even in Debug: at -O0 the compiler emits out-of-line copies of inline helpers built
    # with this ISA's flags, and the linker may hand one to code running on an older CPU.
    set_source_files_properties("${source}" PROPERTIES COMPILE_OPTIONS "${KVPACK_CPU_FLAGS_${isa}};-O2")
    list(APPEND sources "${source}")
  endforeach()
  add_library(${target} STATIC ${sources})
  target_link_libraries(${target} PUBLIC kvpack)
  target_compile_definitions(${target} INTERFACE KVPACK_HAS_CPU_DISPATCH=1)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()
