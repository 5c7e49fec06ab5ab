# ShardoptInstall.cmake: `cmake --install` rules and the package files.
#
#   libraries  libshardopt (C and C++), libshardopt_fortran (the Fortran module), and, when
#              CUDA was built, libshardopt_cuda (the CUDA backend and the NCCL communicator),
#              when LibTorch was found, libshardopt_torch (the LibTorch adapter)
#   headers    include/shardopt/*.h, *.hpp, the generated shardopt_version.h, shardopt_config.h
#   Fortran    shardopt.mod in include/shardopt/fortran/<compiler>-<major version>/ (a .mod
#              file is only readable by the compiler that wrote it; SHARDOPT_INSTALL_FORTRAN_MODDIR)
#   tools      bin/shardopt-plan, bin/shardopt-export
#   CMake      find_package(shardopt [COMPONENTS fortran cuda torch]): shardopt::shardopt,
#              shardopt::fortran, with the cuda component shardopt::cuda, with the torch
#              component shardopt::torch (the LibTorch adapter; finds Torch); usable from
#              projects in any of C, C++ and Fortran. Also exported to the build tree
#              (-Dshardopt_DIR=<build dir>).
#   pkg-config shardopt.pc (C, C++), shardopt-fortran.pc, shardopt-cuda.pc
include(CMakePackageConfigHelpers)

set(SHARDOPT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardopt CACHE STRING
    "Where the CMake package files are installed (relative to the prefix)")

set(_targets shardopt)
if(TARGET shardopt_fortran)
  list(APPEND _targets shardopt_fortran)  # its .mod: SHARDOPT_INSTALL_FORTRAN_MODDIR
endif()
install(TARGETS ${_targets} EXPORT shardoptTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/shardopt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")
install(FILES ${PROJECT_BINARY_DIR}/include/shardopt/shardopt_version.h
              ${PROJECT_BINARY_DIR}/include/shardopt/shardopt_config.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardopt)
if(TARGET shardopt_fortran)
  install(DIRECTORY ${PROJECT_BINARY_DIR}/fortran_modules/
          DESTINATION ${SHARDOPT_INSTALL_FORTRAN_MODDIR} FILES_MATCHING PATTERN "*.mod")
endif()
install(EXPORT shardoptTargets NAMESPACE shardopt:: DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})
export(EXPORT shardoptTargets NAMESPACE shardopt:: FILE ${PROJECT_BINARY_DIR}/shardoptTargets.cmake)
if(TARGET shardopt_cuda)
  install(TARGETS shardopt_cuda EXPORT shardoptCudaTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(EXPORT shardoptCudaTargets NAMESPACE shardopt:: DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})
  export(EXPORT shardoptCudaTargets NAMESPACE shardopt::
         FILE ${PROJECT_BINARY_DIR}/shardoptCudaTargets.cmake)
endif()

if(TARGET shardopt_torch)
  install(TARGETS shardopt_torch EXPORT shardoptTorchTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(EXPORT shardoptTorchTargets NAMESPACE shardopt:: DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})
  export(EXPORT shardoptTorchTargets NAMESPACE shardopt::
         FILE ${PROJECT_BINARY_DIR}/shardoptTorchTargets.cmake)
endif()

# What consumers must find again. MPI: its C library is in the public interface. OpenMP and
# the C++ runtime: only for a static library, whose objects need them at link time.
get_target_property(_type shardopt TYPE)
set(SHARDOPT_STATIC OFF)
if(_type STREQUAL "STATIC_LIBRARY")
  set(SHARDOPT_STATIC ON)
endif()
set(SHARDOPT_NEEDS_OPENMP OFF)
if(SHARDOPT_STATIC AND OpenMP_CXX_FOUND)
  set(SHARDOPT_NEEDS_OPENMP ON)
endif()
set(SHARDOPT_HAS_FORTRAN OFF)
if(TARGET shardopt_fortran)
  set(SHARDOPT_HAS_FORTRAN ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/shardoptConfig.cmake.in
  ${PROJECT_BINARY_DIR}/shardoptConfig.cmake INSTALL_DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/shardoptConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/shardoptConfig.cmake ${PROJECT_BINARY_DIR}/shardoptConfigVersion.cmake
        DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})

# ---- pkg-config -----------------------------------------------------------------------------------
# As other libraries write them: -L${libdir} -l<name>, the MPI dependency as a pkg-config
# module (Requires), no absolute paths of system libraries. A static library's own
# dependencies (C++ runtime, OpenMP runtime) go into Libs, since `pkg-config --libs` without
# --static must link; a shared library records them itself (Libs.private, for --static).
set(SHARDOPT_PC_REQUIRES "")
set(_mpi_libs "")
if(SHARDOPT_WITH_MPI)
  if(SHARDOPT_MPI_FLAVOR_FOUND STREQUAL "mpich")
    set(SHARDOPT_PC_REQUIRES "mpich")
  elseif(SHARDOPT_MPI_FLAVOR_FOUND STREQUAL "openmpi")
    set(SHARDOPT_PC_REQUIRES "ompi-c")
  else()  # no known module: the libraries by name
    foreach(lib IN LISTS MPI_C_LIB_NAMES)
      string(APPEND _mpi_libs " -l${lib}")
    endforeach()
  endif()
endif()
set(_deps "${_mpi_libs}")
if(OpenMP_CXX_FOUND)
  foreach(lib IN LISTS OpenMP_CXX_LIB_NAMES)
    string(APPEND _deps " -l${lib}")
  endforeach()
endif()
string(APPEND _deps " -lstdc++ -lm")
foreach(lib IN LISTS CMAKE_DL_LIBS)
  string(APPEND _deps " -l${lib}")
endforeach()
string(STRIP "${_deps}" _deps)
if(SHARDOPT_STATIC)
  set(SHARDOPT_PC_LIBS "-L\${libdir} -lshardopt ${_deps}")
  set(SHARDOPT_PC_LIBS_PRIVATE "")
else()
  set(SHARDOPT_PC_LIBS "-L\${libdir} -lshardopt")
  set(SHARDOPT_PC_LIBS_PRIVATE "${_deps}")
endif()
# The prefix is found relative to the .pc file, so the installed tree can be moved.
file(RELATIVE_PATH SHARDOPT_PC_PREFIX "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
string(REGEX REPLACE "/$" "" SHARDOPT_PC_PREFIX "${SHARDOPT_PC_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/shardopt.pc.in ${PROJECT_BINARY_DIR}/shardopt.pc @ONLY)
set(_pc_files ${PROJECT_BINARY_DIR}/shardopt.pc)
if(TARGET shardopt_fortran)
  set(SHARDOPT_PC_FMODDIR "\${prefix}/${SHARDOPT_INSTALL_FORTRAN_MODDIR}")
  configure_file(${PROJECT_SOURCE_DIR}/cmake/shardopt-fortran.pc.in
                 ${PROJECT_BINARY_DIR}/shardopt-fortran.pc @ONLY)
  list(APPEND _pc_files ${PROJECT_BINARY_DIR}/shardopt-fortran.pc)
endif()
if(TARGET shardopt_cuda)
  # The CUDA toolkit and NCCL are not system libraries: their directories are named.
  set(SHARDOPT_PC_CUDA_LIBS "-L${CUDAToolkit_LIBRARY_DIR} -lcublas -lcudart")
  if(SHARDOPT_WITH_NCCL)
    get_filename_component(_nccl_dir "${SHARDOPT_NCCL_LIBRARY}" DIRECTORY)
    string(APPEND SHARDOPT_PC_CUDA_LIBS " -L${_nccl_dir} -lnccl")
  endif()
  set(SHARDOPT_PC_CUDA_CFLAGS "-I${CUDAToolkit_INCLUDE_DIRS}")
  get_target_property(_cuda_type shardopt_cuda TYPE)
  if(_cuda_type STREQUAL "STATIC_LIBRARY")  # see cuda/CMakeLists.txt
    set(SHARDOPT_PC_CUDA_LIBS_PUBLIC
        "-L\${libdir} -Wl,--undefined=shardopt_cuda_link -lshardopt_cuda ${SHARDOPT_PC_CUDA_LIBS}")
    set(SHARDOPT_PC_CUDA_LIBS_PRIVATE "")
  else()
    set(SHARDOPT_PC_CUDA_LIBS_PUBLIC "-L\${libdir} -lshardopt_cuda")
    set(SHARDOPT_PC_CUDA_LIBS_PRIVATE "${SHARDOPT_PC_CUDA_LIBS}")
  endif()
  configure_file(${PROJECT_SOURCE_DIR}/cmake/shardopt-cuda.pc.in
                 ${PROJECT_BINARY_DIR}/shardopt-cuda.pc @ONLY)
  list(APPEND _pc_files ${PROJECT_BINARY_DIR}/shardopt-cuda.pc)
endif()
install(FILES ${_pc_files} DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
