# kiln_cuda_target(<target>): how kiln's own .cu executables (tests/cuda_tu, examples/interop.cu)
# are built: for sm_90 (the H100/H200 kiln targets), as C++20, with host warnings on.
function(kiln_cuda_target target)
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES 90)
  if(CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  else()
    # CMake < 3.26 has no C++20 flag on record for nvcc, though nvcc >= 12 takes one.
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>")
  endif()
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>")
endfunction()
