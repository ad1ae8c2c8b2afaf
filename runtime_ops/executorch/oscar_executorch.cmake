# liboscar_executorch: the ExecuTorch kernel of oscar::attention.out over the shared core.
# Included by runtime_ops/CMakeLists.txt; an Android app's CMake includes it the same way
# (docs/android.md) after defining oscar_core and an `executorch_runtime` target that gives
# the ExecuTorch headers, C10_USING_CUSTOM_GENERATED_MACROS and the runtime library.
add_library(oscar_executorch SHARED ${CMAKE_CURRENT_LIST_DIR}/oscar_et.cc)
target_link_libraries(oscar_executorch PRIVATE oscar_core executorch_runtime)
# Every ExecuTorch symbol must come from the one runtime the host loads: a second copy would
# hold a second, empty operator registry.
target_link_options(oscar_executorch PRIVATE -Wl,--no-undefined)
if(EXECUTORCH_DIR)
  set_target_properties(oscar_executorch PROPERTIES BUILD_RPATH ${EXECUTORCH_DIR}/lib)
endif()
