# Finds NCCL's header (nccl.h); the library itself is opened at run time
# (server/collective/nccl/nccl_library.h), so the build needs no libnccl. Hints: NCCL_ROOT,
# CUDAToolkit_LIBRARY_ROOT, /usr/local/cuda. Defines NCCL::nccl_headers.
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} /usr/local/cuda
  PATH_SUFFIXES include)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL DEFAULT_MSG NCCL_INCLUDE_DIR)
if(NCCL_FOUND AND NOT TARGET NCCL::nccl_headers)
  add_library(NCCL::nccl_headers INTERFACE IMPORTED)
  set_target_properties(NCCL::nccl_headers PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR)
