# ShardoptNCCL.cmake: find NCCL's header and library (NCCL_ROOT, then the CUDA toolkit's
# directories) and define the imported target shardopt::nccl. Sets SHARDOPT_NCCL_FOUND and
# SHARDOPT_NCCL_VERSION.
find_path(SHARDOPT_NCCL_INCLUDE_DIR nccl.h
          HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS}
          PATH_SUFFIXES include)
find_library(SHARDOPT_NCCL_LIBRARY nccl
             HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR}
             PATH_SUFFIXES lib lib64)

set(SHARDOPT_NCCL_FOUND OFF)
if(SHARDOPT_NCCL_INCLUDE_DIR AND SHARDOPT_NCCL_LIBRARY)
  file(STRINGS "${SHARDOPT_NCCL_INCLUDE_DIR}/nccl.h" _nccl_ver
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  string(REGEX REPLACE ".*NCCL_MAJOR +([0-9]+).*NCCL_MINOR +([0-9]+).*NCCL_PATCH +([0-9]+).*"
         "\\1.\\2.\\3" SHARDOPT_NCCL_VERSION "${_nccl_ver}")
  set(SHARDOPT_NCCL_FOUND ON)
  if(NOT TARGET shardopt::nccl)
    add_library(shardopt::nccl UNKNOWN IMPORTED)
    set_target_properties(shardopt::nccl PROPERTIES
      IMPORTED_LOCATION "${SHARDOPT_NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${SHARDOPT_NCCL_INCLUDE_DIR}")
  endif()
  message(STATUS "shardopt: NCCL ${SHARDOPT_NCCL_VERSION} (${SHARDOPT_NCCL_LIBRARY})")
endif()
