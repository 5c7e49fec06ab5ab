# The c10d gloo communicator: its own collective tests, and the optimizer, overlap and
# checkpoint suites (written against test::world()) run over it instead of MPI.
# shardopt_add_c10d_test(NAME SOURCES ...): registered as NAME.np<K>; mpiexec only launches.
function(shardopt_add_c10d_test name)
  add_executable(${name} ${ARGN} ${CMAKE_CURRENT_SOURCE_DIR}/world_c10d.cpp
                 ${CMAKE_CURRENT_SOURCE_DIR}/c10d_main.cpp)
  target_link_libraries(${name} PRIVATE shardopt::torch shardopt_test_support)
  foreach(np IN LISTS SHARDOPT_TEST_RANKS)
    add_test(NAME ${name}.np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${SHARDOPT_MPIEXEC_FLAGS}
                     $<TARGET_FILE:${name}>)
    set_tests_properties(${name}.np${np} PROPERTIES TIMEOUT 600 PROCESSORS ${np}
                         LABELS "torch;c10d" ENVIRONMENT "OMP_NUM_THREADS=1;${SHARDOPT_MPI_TEST_ENV}")
  endforeach()
endfunction()

if(SHARDOPT_WITH_MPI)  # mpiexec launches the processes
  shardopt_add_c10d_test(test_c10d_comm test_c10d_comm.cpp)
  shardopt_add_c10d_test(test_optimizer_c10d ../test_optimizer.cpp)
  shardopt_add_c10d_test(test_overlap_c10d ../test_overlap.cpp)
  shardopt_add_c10d_test(test_checkpoint_c10d ../test_checkpoint.cpp)
  target_include_directories(test_checkpoint_c10d PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_definitions(test_checkpoint_c10d PRIVATE
                             SHARDOPT_TEST_DATA="${PROJECT_SOURCE_DIR}/tests/data"
                             SHARDOPT_EXPORT_EXE="$<TARGET_FILE:shardopt-export>")
  add_dependencies(test_checkpoint_c10d shardopt-export)
endif()
