# Finds what the kvpack target itself needs. Tests, benches and examples find their own extras.
include_guard(GLOBAL)

find_package(Threads REQUIRED)
find_package(xsimd 8 REQUIRED)
# Debian's xsimd export links an `xtl` target it never defines; xtl is only needed for
# XSIMD_ENABLE_XTL_COMPLEX, which kvpack does not use, so an empty stand-in is enough.
if(NOT TARGET xtl)
  add_library(xtl INTERFACE IMPORTED)
endif()
