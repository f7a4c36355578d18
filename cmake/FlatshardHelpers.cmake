# fs_option(NAME DOC DEFAULT): a tri-state option AUTO/ON/OFF.
function(fs_option name doc default)
  set(${name} ${default} CACHE STRING "${doc} (AUTO, ON or OFF)")
  set_property(CACHE ${name} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${name}}" value)
  if(NOT value MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${name} must be AUTO, ON or OFF, not '${${name}}'")
  endif()
  set(${name} ${value} PARENT_SCOPE)
endfunction()

# Warnings for project code only (never for generated or third-party code).
function(fs_project_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
endfunction()

# fs_cc_library(NAME SRCS ... DEPS ...)
function(fs_cc_library name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SRCS})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR}/generated)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
  fs_project_warnings(${name})
endfunction()

# fs_cc_test(NAME SRCS ... DEPS ... [LABELS ...]): one gtest executable, discovered by CTest.
function(fs_cc_test name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE
    FS_SOURCE_DIR="${PROJECT_SOURCE_DIR}" FS_BINARY_DIR="${PROJECT_BINARY_DIR}")
  fs_project_warnings(${name})
  if(ARG_LABELS)
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES LABELS "${ARG_LABELS}")
  else()
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60)
  endif()
endfunction()
