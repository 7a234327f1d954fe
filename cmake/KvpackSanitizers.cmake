# KVPACK_SANITIZE: compile and link every target of this build with sanitizers.
#   -DKVPACK_SANITIZE=address,undefined   AddressSanitizer (with LeakSanitizer) and UBSan
#   -DKVPACK_SANITIZE=thread              ThreadSanitizer
# Meant for clang (Debian's clang 14: cmake/run_sanitizers.sh); GCC takes the same flags. UBSan
# does not recover: the first report aborts the test, so a CI run cannot pass with one.
set(KVPACK_SANITIZE "" CACHE STRING "Sanitizers for every target: address,undefined | address | undefined | thread")
set_property(CACHE KVPACK_SANITIZE PROPERTY STRINGS "" "address,undefined" "address" "undefined" "thread")

if(KVPACK_SANITIZE)
  if(NOT KVPACK_SANITIZE MATCHES "^(address,undefined|undefined,address|address|undefined|thread)$")
    message(FATAL_ERROR "KVPACK_SANITIZE must be address,undefined, address, undefined or thread; got '${KVPACK_SANITIZE}' "
                        "(ThreadSanitizer cannot be combined with AddressSanitizer)")
  endif()
  message(STATUS "kvpack: building with -fsanitize=${KVPACK_SANITIZE}")
  add_compile_options(-fsanitize=${KVPACK_SANITIZE} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${KVPACK_SANITIZE})
  if(KVPACK_SANITIZE MATCHES "undefined")
    add_compile_options(-fno-sanitize-recover=all)
  endif()
endif()

# libFuzzer targets (tests/fuzz/): clang's -fsanitize=fuzzer, best combined with
# KVPACK_SANITIZE=address,undefined.
option(KVPACK_BUILD_FUZZERS "Build the libFuzzer targets in tests/fuzz (clang only)" OFF)
if(KVPACK_BUILD_FUZZERS AND NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "KVPACK_BUILD_FUZZERS needs clang (-fsanitize=fuzzer); this build uses ${CMAKE_CXX_COMPILER_ID}")
endif()
