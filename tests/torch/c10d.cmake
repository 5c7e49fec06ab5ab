# The c10d gloo communicator (included from tests/torch/CMakeLists.txt when SHARDOPT_WITH_C10D):
# its own collective tests, and the optimizer, overlap and checkpoint suites (written against
# test::world()) run over it instead of MPI. No process of these binaries calls MPI: mpiexec
# only launches them (ranks from PMI_RANK/PMI_SIZE or OMPI_COMM_WORLD_*), c10d_main.cpp
# derives the rendezvous file. Without MPI they run as one process, directly.

# shardopt_add_c10d_test(NAME SOURCES ...): one binary, registered as NAME.np<K>.
function(shardopt_add_c10d_test name)
  add_executable(${name} ${ARGN} ${CMAKE_CURRENT_LIST_DIR}/world_c10d.cpp
                 ${CMAKE_CURRENT_LIST_DIR}/c10d_main.cpp)
  target_link_libraries(${name} PRIVATE shardopt::torch GTest::gtest)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)  # support/
  if(SHARDOPT_WITH_MPI AND MPIEXEC_EXECUTABLE)
    set(_ranks ${SHARDOPT_TEST_RANKS})
    if(NOT _ranks)
      set(_ranks 1 2 3 4)
    endif()
    foreach(np IN LISTS _ranks)
      add_test(NAME ${name}.np${np}
               COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${SHARDOPT_MPIEXEC_FLAGS}
                       $<TARGET_FILE:${name}>)
      set_tests_properties(${name}.np${np} PROPERTIES TIMEOUT 600 PROCESSORS ${np}
                           LABELS "torch;c10d"
                           ENVIRONMENT "OMP_NUM_THREADS=1;${SHARDOPT_MPI_TEST_ENV}")
    endforeach()
  else()  # no launcher: a group of one
    add_test(NAME ${name}.np1 COMMAND $<TARGET_FILE:${name}>)
    set_tests_properties(${name}.np1 PROPERTIES TIMEOUT 600 LABELS "torch;c10d"
                         ENVIRONMENT "OMP_NUM_THREADS=1")
  endif()
endfunction()

shardopt_add_c10d_test(test_c10d_comm ${CMAKE_CURRENT_LIST_DIR}/test_c10d_comm.cpp)
# Suites of tests/ that reach the group only through test::world() (test_collectives,
# test_reproducible, test_checkpoint_reshard and the *_mpi C API tests call MPI themselves).
# Stage 3 is the all-gather-heavy path (units gathered on acquire/prefetch).
shardopt_add_c10d_test(test_optimizer_c10d ${PROJECT_SOURCE_DIR}/tests/test_optimizer.cpp)
shardopt_add_c10d_test(test_overlap_c10d ${PROJECT_SOURCE_DIR}/tests/test_overlap.cpp)
shardopt_add_c10d_test(test_zero3_c10d ${PROJECT_SOURCE_DIR}/tests/test_zero3.cpp)
shardopt_add_c10d_test(test_checkpoint_c10d ${PROJECT_SOURCE_DIR}/tests/test_checkpoint.cpp)
# test_checkpoint reads internal headers (src/checkpoint), the committed fixtures and runs the
# export tool, as in tests/CMakeLists.txt.
target_include_directories(test_checkpoint_c10d PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_definitions(test_checkpoint_c10d PRIVATE
                           SHARDOPT_TEST_DATA="${PROJECT_SOURCE_DIR}/tests/data"
                           SHARDOPT_EXPORT_EXE="$<TARGET_FILE:shardopt-export>")
add_dependencies(test_checkpoint_c10d shardopt-export)

# The other rendezvous: a TCP store on loopback that rank 0 serves (MASTER_ADDR/MASTER_PORT,
# as torchrun sets them). A fixed port of the dynamic range; RESOURCE_LOCK keeps ctest -j from
# running two of these at once.
if(SHARDOPT_WITH_MPI AND MPIEXEC_EXECUTABLE)
  add_test(NAME test_c10d_comm.tcpstore.np2
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${SHARDOPT_MPIEXEC_FLAGS}
                   $<TARGET_FILE:test_c10d_comm>
                   --gtest_filter=C10dComm.NameAndSize:C10dComm.ReduceScatter*:C10dComm.AllGather*)
  set_tests_properties(test_c10d_comm.tcpstore.np2 PROPERTIES TIMEOUT 300 PROCESSORS 2
                       LABELS "torch;c10d" RESOURCE_LOCK shardopt_gloo_tcp_port
                       ENVIRONMENT "OMP_NUM_THREADS=1;MASTER_ADDR=127.0.0.1;MASTER_PORT=29517;SHARDOPT_GLOO_HOST=127.0.0.1;${SHARDOPT_MPI_TEST_ENV}")
endif()
