# Finds libtorch through the Python interpreter's torch package and defines
# the imported target lowbit::torch with only the libraries an op library
# needs (c10, torch_cpu, and the CUDA pair when building CUDA). Unlike
# find_package(Torch) it never links torch_python and needs no cuDNN/NVTX
# discovery, which keeps the op library loadable from any CPython.
find_package(Python3 COMPONENTS Interpreter)
set(LOWBIT_TORCH_FOUND OFF)
if(NOT Python3_Interpreter_FOUND)
  message(WARNING "lowbit: no Python interpreter, op library not built")
  return()
endif()
execute_process(
  COMMAND ${Python3_EXECUTABLE} -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE _lowbit_torch_info
  RESULT_VARIABLE _lowbit_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _lowbit_torch_rc EQUAL 0)
  message(WARNING "lowbit: 'import torch' failed under ${Python3_EXECUTABLE}, op library not built")
  return()
endif()
string(REPLACE "\n" ";" _lowbit_torch_info "${_lowbit_torch_info}")
list(GET _lowbit_torch_info 0 LOWBIT_TORCH_DIR)
list(GET _lowbit_torch_info 1 LOWBIT_TORCH_CXX11_ABI)
list(GET _lowbit_torch_info 2 LOWBIT_TORCH_VERSION)
message(STATUS "lowbit: torch ${LOWBIT_TORCH_VERSION}")

add_library(lowbit::torch INTERFACE IMPORTED)
target_include_directories(lowbit::torch INTERFACE ${LOWBIT_TORCH_DIR}/include)
target_compile_definitions(lowbit::torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${LOWBIT_TORCH_CXX11_ABI})
set(_lowbit_torch_libs c10 torch_cpu torch)
if(LOWBIT_WITH_CUDA)
  list(APPEND _lowbit_torch_libs c10_cuda torch_cuda)
  target_link_libraries(lowbit::torch INTERFACE CUDA::cudart)
endif()
foreach(_lib ${_lowbit_torch_libs})
  set(_path ${LOWBIT_TORCH_DIR}/lib/lib${_lib}.so)
  if(NOT EXISTS ${_path})
    message(FATAL_ERROR "lowbit: ${_path} missing (torch built without CUDA while nvcc was found? pass -DLOWBIT_ENABLE_CUDA=OFF)")
  endif()
  target_link_libraries(lowbit::torch INTERFACE ${_path})
endforeach()
set(LOWBIT_TORCH_FOUND ON)
