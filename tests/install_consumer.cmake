# The installed C++ package, as a downstream project uses it: installs the
# build into a fresh prefix, configures examples/cpp (six CMake lines:
# find_package(kvindex CONFIG REQUIRED), kvindex::kvindex) against it,
# builds and runs it. ctest runs it as install.consumer:
#   cmake -DBUILD_DIR=<build> -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch> -DGENERATOR=<gen> -P tests/install_consumer.cmake
foreach(v BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "install_consumer.cmake: -D${v}=... missing")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(f include/kvindex/KVIndex.h lib/cmake/kvindex/kvindexConfig.cmake)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "the install lacks ${f}")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/cpp -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/quickstart)
if(NOT last_output MATCHES "relative error [0-9.e+-]+ reading [0-9]+ of 4096 tokens")
  message(FATAL_ERROR "quickstart printed: ${last_output}")
endif()
message(STATUS "quickstart: ${last_output}")
