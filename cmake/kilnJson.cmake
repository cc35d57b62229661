# Finds nlohmann/json (k::save and k::load read and write safetensors headers with it) and leaves
# its include directory in KILN_JSON_INCLUDE. The package's own config is asked first and the
# header searched for otherwise, and this file is installed beside kilnConfig.cmake, so consumers
# run the same search on their own machine.
if(NOT KILN_JSON_INCLUDE)
  find_package(nlohmann_json CONFIG QUIET)
  if(TARGET nlohmann_json::nlohmann_json)
    get_target_property(_kiln_json_hint nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
  endif()
endif()
find_path(KILN_JSON_INCLUDE nlohmann/json.hpp
  HINTS ${_kiln_json_hint}
  DOC "Directory that contains nlohmann/json.hpp")
unset(_kiln_json_hint)
