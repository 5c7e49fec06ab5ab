# ShardoptInstall.cmake: `cmake --install` rules: headers, the library (and the Fortran
# module library and .mod), a CMake package (find_package(shardopt) -> shardopt::shardopt,
# shardopt::fortran) and a pkg-config file (shardopt.pc).
include(CMakePackageConfigHelpers)

set(SHARDOPT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardopt CACHE STRING
    "Where the CMake package files are installed (relative to the prefix)")

set(_targets shardopt)
if(TARGET shardopt_fortran)
  list(APPEND _targets shardopt_fortran)
endif()
install(TARGETS ${_targets} EXPORT shardoptTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/shardopt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")
install(FILES ${PROJECT_BINARY_DIR}/include/shardopt/shardopt_version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardopt)
if(TARGET shardopt_fortran)
  # .mod files are specific to the compiler (and its version) that wrote them.
  install(DIRECTORY ${PROJECT_BINARY_DIR}/fortran_modules/
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardopt/fortran FILES_MATCHING PATTERN "*.mod")
endif()

install(EXPORT shardoptTargets NAMESPACE shardopt:: DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})

# What the package's consumers must find again: MPI is in the public interface; OpenMP only
# when the library is static (its objects then need the runtime at link time).
get_target_property(_type shardopt TYPE)
set(SHARDOPT_STATIC OFF)
if(_type STREQUAL "STATIC_LIBRARY")
  set(SHARDOPT_STATIC ON)
endif()
set(SHARDOPT_NEEDS_OPENMP OFF)
if(SHARDOPT_STATIC AND OpenMP_CXX_FOUND)
  set(SHARDOPT_NEEDS_OPENMP ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/shardoptConfig.cmake.in
  ${PROJECT_BINARY_DIR}/shardoptConfig.cmake INSTALL_DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/shardoptConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/shardoptConfig.cmake ${PROJECT_BINARY_DIR}/shardoptConfigVersion.cmake
        DESTINATION ${SHARDOPT_INSTALL_CMAKEDIR})

# ---- pkg-config ---------------------------------------------------------------------------
# A static libshardopt needs its dependencies on the link line of every consumer (C and
# Fortran programs too): MPI, the OpenMP runtime and the C++ standard library.
set(_deps "")
if(SHARDOPT_WITH_MPI)
  foreach(lib IN LISTS MPI_CXX_LIBRARIES)
    string(APPEND _deps " ${lib}")
  endforeach()
endif()
if(OpenMP_CXX_FOUND)
  foreach(lib IN LISTS OpenMP_CXX_LIBRARIES)
    string(APPEND _deps " ${lib}")
  endforeach()
endif()
if(SHARDOPT_WITH_CUDA)
  string(APPEND _deps " -L${CUDAToolkit_LIBRARY_DIR} -lcudart")
  if(SHARDOPT_WITH_NCCL)
    string(APPEND _deps " ${SHARDOPT_NCCL_LIBRARY}")
  endif()
endif()
string(APPEND _deps " -lstdc++ -lm")
if(SHARDOPT_STATIC)
  set(SHARDOPT_PC_LIBS "-L\${libdir} -lshardopt${_deps}")
  set(SHARDOPT_PC_LIBS_PRIVATE "")
else()
  set(SHARDOPT_PC_LIBS "-L\${libdir} -lshardopt")
  set(SHARDOPT_PC_LIBS_PRIVATE "${_deps}")
endif()
set(SHARDOPT_PC_CFLAGS "-I\${includedir}")
if(SHARDOPT_WITH_MPI)
  # So that shardopt.h may include <mpi.h> (for shardopt_create_mpi) without an MPI wrapper.
  foreach(dir IN LISTS MPI_C_INCLUDE_DIRS)
    string(APPEND SHARDOPT_PC_CFLAGS " -I${dir}")
  endforeach()
endif()
# The prefix is found relative to the .pc file, so the installed tree can be moved
# (cmake --install --prefix elsewhere).
file(RELATIVE_PATH SHARDOPT_PC_PREFIX "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
string(REGEX REPLACE "/$" "" SHARDOPT_PC_PREFIX "${SHARDOPT_PC_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/shardopt.pc.in ${PROJECT_BINARY_DIR}/shardopt.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/shardopt.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
