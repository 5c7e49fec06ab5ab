# run.cmake: installs a shardopt build into a scratch prefix, then builds and runs the
# consumer project against it (find_package) and a C program against it (pkg-config).
#
#   cmake -DBUILD_DIR=... -DWORK_DIR=... -DCONFIG=... -DC_COMPILER=... -DCXX_COMPILER=...
#         [-DFortran_COMPILER=...] -DLIBDIR=lib -P run.cmake
cmake_minimum_required(VERSION 3.25)
set(src ${CMAKE_CURRENT_LIST_DIR})
set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "failed (${rc}): ${cmd}")
  endif()
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --config ${CONFIG})

# ---- find_package(shardopt) -----------------------------------------------------------------
set(fortran -DCONSUMER_FORTRAN=OFF)
if(Fortran_COMPILER)
  set(fortran -DCONSUMER_FORTRAN=ON -DCMAKE_Fortran_COMPILER=${Fortran_COMPILER})
endif()
run(${CMAKE_COMMAND} -S ${src} -B ${WORK_DIR}/build -DCMAKE_BUILD_TYPE=${CONFIG}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_C_COMPILER=${C_COMPILER}
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${fortran})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build --config ${CONFIG})
run(${WORK_DIR}/build/consumer_c)
run(${WORK_DIR}/build/consumer_cpp)
if(Fortran_COMPILER)
  run(${WORK_DIR}/build/consumer_f)
endif()

# ---- pkg-config --------------------------------------------------------------------------------
find_program(PKG_CONFIG NAMES pkg-config pkgconf REQUIRED)
set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
execute_process(COMMAND ${PKG_CONFIG} --cflags --libs shardopt OUTPUT_VARIABLE flags
                RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pkg-config does not find shardopt.pc in ${prefix}/${LIBDIR}/pkgconfig")
endif()
message(STATUS "pkg-config --cflags --libs shardopt: ${flags}")
separate_arguments(flags UNIX_COMMAND "${flags}")
run(${C_COMPILER} -std=c99 ${src}/consumer.c -o ${WORK_DIR}/consumer_pkgconfig ${flags})
run(${WORK_DIR}/consumer_pkgconfig)
