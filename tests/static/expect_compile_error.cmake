# cmake -DBUILD_DIR=<build> -DTARGET=<target> [-DCONFIG=<cfg>] -DEXPECT=<re>|<re>... -P expect_compile_error.cmake
#
# Builds TARGET (an EXCLUDE_FROM_ALL object library) and passes only when the build fails AND
# its output matches every regular expression in EXPECT. "|" separates the expressions, except
# inside parentheses, where it keeps its regex meaning (alternation).
cmake_minimum_required(VERSION 3.25)
foreach(var BUILD_DIR TARGET EXPECT)
  if(NOT ${var})
    message(FATAL_ERROR "expect_compile_error.cmake: ${var} is not set")
  endif()
endforeach()

# Split EXPECT on top-level "|".
set(patterns "")
set(current "")
set(depth 0)
string(LENGTH "${EXPECT}" length)
math(EXPR last "${length} - 1")
foreach(i RANGE ${last})
  string(SUBSTRING "${EXPECT}" ${i} 1 c)
  if(c STREQUAL "(")
    math(EXPR depth "${depth} + 1")
  elseif(c STREQUAL ")")
    math(EXPR depth "${depth} - 1")
  endif()
  if(c STREQUAL "|" AND depth EQUAL 0)
    list(APPEND patterns "${current}")
    set(current "")
  else()
    string(APPEND current "${c}")
  endif()
endforeach()
list(APPEND patterns "${current}")

set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${config_args}
                OUTPUT_VARIABLE output ERROR_VARIABLE output RESULT_VARIABLE result)
if(result EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not:\n${output}")
endif()
set(missing "")
foreach(pattern IN LISTS patterns)
  if(NOT output MATCHES "${pattern}")
    string(APPEND missing "\n  ${pattern}")
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "${TARGET} failed to compile, but not for the expected reason; missing from "
                      "the diagnostics:${missing}\n--- build output ---\n${output}")
endif()
message(STATUS "${TARGET} failed to compile as expected (matched: ${patterns})")
