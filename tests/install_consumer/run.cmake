# run.cmake: installs a shardopt build into a scratch prefix, or first configures, builds and
# installs a copy of the project (SOURCE_DIR, with BUILD_ARGS, e.g. -DBUILD_SHARED_LIBS=ON),
# then uses it as a new user would:
#   - CMake projects in exactly one language each (C, C++, Fortran) with find_package(shardopt),
#     configured with the CUDA toolkit hidden (CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit);
#   - a C++ project against the build tree (-Dshardopt_DIR=<build dir>);
#   - C and Fortran programs built with pkg-config only (shardopt.pc, shardopt-fortran.pc),
#     one of them including shardopt.h before <mpi.h> with implicit declarations as errors;
#   - a Fortran program that uses mpi_f08 itself: built with MPI::MPI_Fortran (CMake) and with
#     mpif90 plus shardopt-fortran.pc; with the plain compiler and the .pc alone it must not
#     link (docs/packaging.md says it needs one of the two);
#   - ldd: no CPU-only program needs libcudart, libnccl or libcublas;
#   - the installed tools run from the prefix without LD_LIBRARY_PATH (install RPATH);
#   - with LibTorch, a LibTorch program through find_package(shardopt COMPONENTS torch);
#   - the CUDA backend: found by programs linked with shardopt::cuda, and (shared library)
#     loaded on demand by a program that was not.
#
#   cmake -DBUILD_DIR=... | -DSOURCE_DIR=... [-DBUILD_ARGS=a|b] -DWORK_DIR=... -DCONFIG=...
#         -DC_COMPILER=... -DCXX_COMPILER=... [-DFortran_COMPILER=...]
#         [-DMPI_Fortran_COMPILER=mpif90 -DMPI_F08=ON] -DLIBDIR=lib
#         -DWITH_MPI=ON|OFF -DWITH_CUDA=ON|OFF [-DWITH_TORCH=ON] -P run.cmake
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
# output(VAR cmd...): runs cmd, fails unless it succeeds, VAR = its stdout.
function(output var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "failed (${rc}): ${cmd}\n${out}${err}")
  endif()
  set(${var} "${out}" PARENT_SCOPE)
endfunction()
# no_cuda_libs(exe): ldd must not list libcudart, libnccl, libcublas or libcuda.
function(no_cuda_libs exe)
  output(deps ldd ${exe})
  if(deps MATCHES "libcudart|libnccl|libcublas|libcuda\\.")
    message(FATAL_ERROR "${exe} needs CUDA libraries although it uses only the CPU:\n${deps}")
  endif()
  message(STATUS "ldd ${exe}: no CUDA libraries")
endfunction()

set(tree ${BUILD_DIR})
if(SOURCE_DIR)
  set(tree ${WORK_DIR}/shardopt-build)
  string(REPLACE "|" ";" args "${BUILD_ARGS}")
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${tree} -DCMAKE_BUILD_TYPE=${CONFIG}
      -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
      -DSHARDOPT_BUILD_TESTS=OFF -DSHARDOPT_BUILD_EXAMPLES=OFF -DSHARDOPT_BUILD_BENCHMARKS=OFF
      -DSHARDOPT_INSTALL=ON ${args})
  run(${CMAKE_COMMAND} --build ${tree} --config ${CONFIG} -j 2)
endif()
run(${CMAKE_COMMAND} --install ${tree} --prefix ${prefix} --config ${CONFIG})
file(GLOB shared_libs ${prefix}/${LIBDIR}/libshardopt.so*)
if(shared_libs)
  set(kind shared)
else()
  set(kind static)
endif()
message(STATUS "installed a ${kind} libshardopt into ${prefix}")

# ---- the installed tools run from the prefix -----------------------------------------------
foreach(tool shardopt-plan shardopt-export)
  output(v ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${prefix}/bin/${tool} --version)
  message(STATUS "${tool}: ${v}")
endforeach()

# ---- find_package(shardopt) from one-language projects ---------------------------------------
set(langs C CXX)
if(Fortran_COMPILER)
  list(APPEND langs Fortran)
endif()
foreach(lang IN LISTS langs)
  set(b ${WORK_DIR}/consumer_${lang})
  set(cuda OFF)
  if(lang STREQUAL "CXX" AND WITH_CUDA)
    set(cuda ON)  # shardopt::cuda: its consumers do find the CUDA toolkit
  endif()
  set(hide_cuda -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
  if(cuda)
    set(hide_cuda "")
  endif()
  set(f08 OFF)
  if(lang STREQUAL "Fortran" AND WITH_MPI AND MPI_F08)
    set(f08 ON)
  endif()
  run(${CMAKE_COMMAND} -S ${src} -B ${b} -DCMAKE_BUILD_TYPE=${CONFIG} -DCONSUMER_LANGUAGE=${lang}
      -DCONSUMER_CUDA=${cuda} -DCONSUMER_MPI_F08=${f08} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_C_COMPILER=${C_COMPILER}
      -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_Fortran_COMPILER=${Fortran_COMPILER}
      ${hide_cuda})
  run(${CMAKE_COMMAND} --build ${b} --config ${CONFIG})
endforeach()
run(${WORK_DIR}/consumer_C/consumer_c)
no_cuda_libs(${WORK_DIR}/consumer_C/consumer_c)
run(${WORK_DIR}/consumer_CXX/consumer_cpp)
no_cuda_libs(${WORK_DIR}/consumer_CXX/consumer_cpp)
if(Fortran_COMPILER)
  run(${WORK_DIR}/consumer_Fortran/consumer_f)
  no_cuda_libs(${WORK_DIR}/consumer_Fortran/consumer_f)
  if(WITH_MPI AND MPI_F08)
    run(${WORK_DIR}/consumer_Fortran/consumer_f08)
  endif()
endif()
if(WITH_CUDA)
  run(${WORK_DIR}/consumer_CXX/consumer_cuda)
endif()
# The CUDA backend asked for by a program not linked with it: a shared core loads it, a
# static one cannot, and without CUDA there is none.
output(answer ${WORK_DIR}/consumer_C/consumer_device)
message(STATUS "consumer_device: ${answer}")
if(WITH_CUDA AND kind STREQUAL "shared")
  set(expected "^loaded")
else()
  set(expected "^unsupported")
endif()
if(NOT answer MATCHES "${expected}")
  message(FATAL_ERROR "consumer_device: expected '${expected}', got '${answer}'")
endif()

# The LibTorch adapter: find_package(shardopt COMPONENTS torch) finds Torch and the adapter.
if(WITH_TORCH)
  run(${CMAKE_COMMAND} -S ${src} -B ${WORK_DIR}/consumer_torch -DCMAKE_BUILD_TYPE=${CONFIG}
      -DCONSUMER_LANGUAGE=CXX -DCONSUMER_TORCH=ON -DCMAKE_PREFIX_PATH=${prefix}
      -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer_torch --config ${CONFIG})
  run(${WORK_DIR}/consumer_torch/consumer_torch)
endif()

# ---- the build tree ----------------------------------------------------------------------------
run(${CMAKE_COMMAND} -S ${src} -B ${WORK_DIR}/consumer_buildtree -DCMAKE_BUILD_TYPE=${CONFIG}
    -DCONSUMER_LANGUAGE=CXX -Dshardopt_DIR=${tree} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer_buildtree --config ${CONFIG})
run(${WORK_DIR}/consumer_buildtree/consumer_cpp)

# ---- pkg-config --------------------------------------------------------------------------------
find_program(PKG_CONFIG NAMES pkg-config pkgconf REQUIRED)
set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
output(pc ${CMAKE_COMMAND} -E cat ${prefix}/${LIBDIR}/pkgconfig/shardopt.pc)
if(pc MATCHES "(-I|-L|^|[ \t])/usr/(lib|include)")
  message(FATAL_ERROR "shardopt.pc names system paths:\n${pc}")
endif()
output(flags ${PKG_CONFIG} --cflags --libs shardopt)
string(STRIP "${flags}" flags)
message(STATUS "pkg-config --cflags --libs shardopt: ${flags}")
separate_arguments(flags UNIX_COMMAND "${flags}")
set(rpath -Wl,-rpath,${prefix}/${LIBDIR})
run(${C_COMPILER} -std=c99 ${src}/consumer.c -o ${WORK_DIR}/pc_consumer_c ${flags} -lm ${rpath})
run(${WORK_DIR}/pc_consumer_c)
no_cuda_libs(${WORK_DIR}/pc_consumer_c)
if(WITH_MPI)
  run(${C_COMPILER} -std=c99 -Werror=implicit-function-declaration ${src}/consumer_mpi.c
      -o ${WORK_DIR}/pc_consumer_mpi ${flags} ${rpath})
  run(${WORK_DIR}/pc_consumer_mpi)
endif()
if(Fortran_COMPILER)
  output(fflags ${PKG_CONFIG} --cflags --libs shardopt-fortran)
  string(STRIP "${fflags}" fflags)
  message(STATUS "pkg-config --cflags --libs shardopt-fortran: ${fflags}")
  separate_arguments(fflags UNIX_COMMAND "${fflags}")
  run(${Fortran_COMPILER} ${src}/consumer.f90 -o ${WORK_DIR}/pc_consumer_f ${fflags} ${rpath})
  run(${WORK_DIR}/pc_consumer_f)
  no_cuda_libs(${WORK_DIR}/pc_consumer_f)
  if(WITH_MPI AND MPI_F08 AND MPI_Fortran_COMPILER)
    # The .pc file brings the C MPI library only: a program using mpi_f08 does not link with
    # the plain compiler (what docs/packaging.md warns about), and does with mpif90.
    execute_process(COMMAND ${Fortran_COMPILER} ${src}/consumer_f08.f90 -o ${WORK_DIR}/pc_consumer_f08_plain
                            ${fflags} ${rpath}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(rc EQUAL 0)
      message(FATAL_ERROR "consumer_f08 linked without MPI's Fortran bindings: docs/packaging.md "
                          "says it needs mpif90 or MPI::MPI_Fortran; update it")
    elseif(NOT "${out}${err}" MATCHES "undefined reference[^\n]*[Mm][Pp][Ii]_")
      message(FATAL_ERROR "consumer_f08 without mpif90 failed, but not for want of the mpi_f08 "
                          "bindings:\n${out}${err}")
    endif()
    message(STATUS "consumer_f08 with ${Fortran_COMPILER} and shardopt-fortran.pc alone fails, "
                   "as documented")
    run(${MPI_Fortran_COMPILER} ${src}/consumer_f08.f90 -o ${WORK_DIR}/pc_consumer_f08 ${fflags} ${rpath})
    run(${WORK_DIR}/pc_consumer_f08)
  endif()
endif()
message(STATUS "install_consumer (${kind}): all consumers work")
