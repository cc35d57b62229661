# Drives one package test as a ctest test: optionally installs kiln into a fresh prefix,
# then configures, builds and runs a downstream project from scratch.
# Inputs (-D): PROJECT_DIR BUILD_DIR GENERATOR MAKE_PROGRAM CXX PREFIX_PATH CUDA_ROOT,
# plus KILN_SOURCE_DIR (add_subdirectory) or INSTALL_FROM and PREFIX (find_package).

function(step what)
  message(STATUS "package test: ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test: ${what} failed (${rc})")
  endif()
endfunction()

string(REPLACE "|" ";" prefix_path "${PREFIX_PATH}")
if(DEFINED ENV{CMAKE_PREFIX_PATH})
  string(REPLACE ":" ";" env_paths "$ENV{CMAKE_PREFIX_PATH}")
  list(APPEND prefix_path ${env_paths})
endif()
set(configure_args -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=${CXX}")
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CUDA_ROOT)
  list(APPEND configure_args "-DCUDAToolkit_ROOT=${CUDA_ROOT}")
endif()
if(KILN_SOURCE_DIR)
  list(APPEND configure_args "-DKILN_SOURCE_DIR=${KILN_SOURCE_DIR}")
endif()

# A fresh prefix, so a header deleted from the tree cannot linger in the package.
if(INSTALL_FROM)
  file(REMOVE_RECURSE "${PREFIX}")
  step("install kiln into ${PREFIX}"
    "${CMAKE_COMMAND}" --install "${INSTALL_FROM}" --prefix "${PREFIX}" --config Release)
  list(PREPEND prefix_path "${PREFIX}")
endif()
# Through the environment, which takes a ':'-list and spares us escaping ';'.
list(JOIN prefix_path ":" env_prefix_path)
set(ENV{CMAKE_PREFIX_PATH} "${env_prefix_path}")

file(REMOVE_RECURSE "${BUILD_DIR}")
step("configure ${PROJECT_DIR}" "${CMAKE_COMMAND}" -S "${PROJECT_DIR}" -B "${BUILD_DIR}" ${configure_args})
step("build" "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --config Release)
set(exe "${BUILD_DIR}/main")
if(NOT EXISTS "${exe}")
  set(exe "${BUILD_DIR}/Release/main")  # multi-config generators
endif()
step("run ${exe}" "${exe}")
