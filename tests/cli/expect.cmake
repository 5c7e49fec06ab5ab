# expect.cmake: runs one command line and checks how it ends.
#   cmake -DCMD="exe|arg|arg" -DEXPECT=ok|error -DREGEX=... [-DNOT_REGEX=...] -P expect.cmake
# ok: exit code 0. error: a non-zero exit code that the program chose (not a signal, not an
# abort from an uncaught exception). In both cases stdout+stderr must match REGEX (and must
# not match NOT_REGEX), so "a clear error" is checked, not just "some failure".
string(REPLACE "|" ";" cmd "${CMD}")
execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
set(all "${out}${err}")
string(REPLACE ";" " " shown "${cmd}")
if(EXPECT STREQUAL "ok")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "${shown}: expected exit code 0, got '${rc}'\n${all}")
  endif()
elseif(EXPECT STREQUAL "error")
  if(NOT rc MATCHES "^[0-9]+$" OR rc STREQUAL "0" OR rc GREATER 127)
    message(FATAL_ERROR "${shown}: expected a non-zero exit code it chose, got '${rc}'\n${all}")
  endif()
else()
  message(FATAL_ERROR "EXPECT must be ok or error")
endif()
if(NOT all MATCHES "${REGEX}")
  message(FATAL_ERROR "${shown}: output does not match '${REGEX}':\n${all}")
endif()
if(DEFINED NOT_REGEX AND all MATCHES "${NOT_REGEX}")
  message(FATAL_ERROR "${shown}: output matches '${NOT_REGEX}':\n${all}")
endif()
message(STATUS "${shown}: exit code ${rc} as expected\n${all}")
