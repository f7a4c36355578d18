#pragma once
// Status propagation macros. Debian's abseil 20220623 predates ABSL_RETURN_IF_ERROR;
// these have the same shape so a later switch is mechanical.

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define FS_STATUS_CONCAT_INNER_(a, b) a##b
#define FS_STATUS_CONCAT_(a, b) FS_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define FS_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status fs_status_ = (expr);      \
    if (!fs_status_.ok()) return fs_status_; \
  } while (false)

// `FS_ASSIGN_OR_RETURN(T x, StatusOrExpr)`: assigns the value or returns the error.
#define FS_ASSIGN_OR_RETURN(lhs, rexpr) \
  FS_ASSIGN_OR_RETURN_IMPL_(FS_STATUS_CONCAT_(fs_statusor_, __LINE__), lhs, rexpr)
#define FS_ASSIGN_OR_RETURN_IMPL_(var, lhs, rexpr) \
  auto var = (rexpr);                              \
  if (!var.ok()) return std::move(var).status();   \
  lhs = std::move(var).value()
