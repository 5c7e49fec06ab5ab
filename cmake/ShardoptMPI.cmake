# ShardoptMPI.cmake: find one MPI and use it consistently (compiler wrapper, library, launcher).
#
# Debian's alternatives may point mpicc/mpiexec at Open MPI while MPICH is also installed;
# mixing one's headers with the other's launcher fails at run time. Unless the user chose
# (MPI_C_COMPILER / MPIEXEC_EXECUTABLE, or SHARDOPT_MPI_FLAVOR=openmpi), MPICH's own
# suffixed wrappers are used when present. Sets SHARDOPT_MPI_FLAVOR_FOUND (mpich|openmpi|other),
# SHARDOPT_MPIEXEC_FLAGS (e.g. --oversubscribe) and SHARDOPT_MPI_TEST_ENV for tests.

set(SHARDOPT_MPI_FLAVOR "mpich" CACHE STRING "Preferred MPI: mpich, openmpi or system (PATH)")
set_property(CACHE SHARDOPT_MPI_FLAVOR PROPERTY STRINGS mpich openmpi system)

if(NOT MPI_C_COMPILER AND NOT MPI_CXX_COMPILER AND NOT SHARDOPT_MPI_FLAVOR STREQUAL "system")
  if(SHARDOPT_MPI_FLAVOR STREQUAL "mpich")
    set(_suffix mpich)
  else()
    set(_suffix openmpi)
  endif()
  find_program(_shardopt_mpicc NAMES mpicc.${_suffix} NO_CACHE)
  find_program(_shardopt_mpicxx NAMES mpicxx.${_suffix} mpic++.${_suffix} NO_CACHE)
  find_program(_shardopt_mpifort NAMES mpifort.${_suffix} mpif90.${_suffix} NO_CACHE)
  find_program(_shardopt_mpiexec NAMES mpiexec.${_suffix} mpirun.${_suffix} NO_CACHE)
  if(_shardopt_mpicc AND _shardopt_mpicxx AND _shardopt_mpiexec)
    set(MPI_C_COMPILER "${_shardopt_mpicc}" CACHE FILEPATH "MPI C wrapper")
    set(MPI_CXX_COMPILER "${_shardopt_mpicxx}" CACHE FILEPATH "MPI C++ wrapper")
    if(_shardopt_mpifort)
      set(MPI_Fortran_COMPILER "${_shardopt_mpifort}" CACHE FILEPATH "MPI Fortran wrapper")
    endif()
    set(MPIEXEC_EXECUTABLE "${_shardopt_mpiexec}" CACHE FILEPATH "MPI launcher")
  endif()
endif()

set(_optional_components "")
if(CMAKE_Fortran_COMPILER)
  # Only the Fortran drivers need it; the library does not.
  list(APPEND _optional_components Fortran)
endif()
if(SHARDOPT_MPI STREQUAL "ON")
  find_package(MPI REQUIRED COMPONENTS C CXX OPTIONAL_COMPONENTS ${_optional_components})
else()
  find_package(MPI COMPONENTS C CXX OPTIONAL_COMPONENTS ${_optional_components})
endif()

set(SHARDOPT_MPI_FLAVOR_FOUND "other")
set(SHARDOPT_MPIEXEC_FLAGS "")
set(SHARDOPT_MPI_TEST_ENV "")
if(MPI_CXX_FOUND AND MPIEXEC_EXECUTABLE)
  execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version OUTPUT_VARIABLE _ver ERROR_VARIABLE _ver
                  RESULT_VARIABLE _rc TIMEOUT 20)
  if(_ver MATCHES "Open MPI|OpenRTE")
    set(SHARDOPT_MPI_FLAVOR_FOUND "openmpi")
    set(SHARDOPT_MPIEXEC_FLAGS --oversubscribe)
    # Containers run as root; Open MPI refuses that unless told.
    set(SHARDOPT_MPI_TEST_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  elseif(_ver MATCHES "HYDRA|MPICH")
    set(SHARDOPT_MPI_FLAVOR_FOUND "mpich")
  endif()
  set(SHARDOPT_MPIEXEC_FLAGS_CACHED "${SHARDOPT_MPIEXEC_FLAGS}" CACHE INTERNAL "for scripts/")
  message(STATUS "shardopt: MPI ${MPI_CXX_VERSION} (${SHARDOPT_MPI_FLAVOR_FOUND}), "
                 "launcher ${MPIEXEC_EXECUTABLE}")
endif()
