// Small Status helpers: Debian's Abseil 20220623 ships no RETURN_IF_ERROR.
#ifndef OSCARKV_KERNELS_STATUS_MACROS_H_
#define OSCARKV_KERNELS_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define OSCARKV_CONCAT_INNER_(a, b) a##b
#define OSCARKV_CONCAT_(a, b) OSCARKV_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define OSCARKV_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status oscarkv_status_ = (expr);           \
    if (!oscarkv_status_.ok()) return oscarkv_status_; \
  } while (0)

// `lhs = value of expr` where expr is an absl::StatusOr<T>; returns its status on error.
#define OSCARKV_ASSIGN_OR_RETURN(lhs, expr) \
  OSCARKV_ASSIGN_OR_RETURN_IMPL_(OSCARKV_CONCAT_(oscarkv_statusor_, __LINE__), lhs, expr)
#define OSCARKV_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

#endif  // OSCARKV_KERNELS_STATUS_MACROS_H_
