# Finds Boost.Hana and leaves its include directory in KILN_HANA_INCLUDE.
# FindBoost is gone from CMake 4, so we ask Boost's own config package first (it
# knows where a non-system Boost lives) and otherwise search for the header. This
# file is installed beside kilnConfig.cmake, so consumers run the same search on
# their own machine instead of inheriting a path baked in at our build time.
if(NOT KILN_HANA_INCLUDE)
  find_package(Boost CONFIG QUIET)
endif()
find_path(KILN_HANA_INCLUDE boost/hana.hpp
  HINTS ${Boost_INCLUDE_DIRS}
  DOC "Directory that contains boost/hana.hpp")
