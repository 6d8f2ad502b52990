"""Central error collection with severities; the controller's exception policy reads its health."""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class ErrorSeverity(Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass
class ErrorInfo:
    error_id: str
    timestamp: float
    module_name: str
    work_context: str
    severity: ErrorSeverity
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    exception_type: str | None = None
    exception_traceback: str | None = None

    @property
    def is_critical(self) -> bool:
        return bool(self.details.get("critical", False))


class ErrorReporter:
    """Keeps the last ``max_errors`` reports; health looks at the ones inside ``recent_window_s``."""

    def __init__(self, max_errors: int = 1000, recent_window_s: float = 300.0):
        self._errors: deque[ErrorInfo] = deque(maxlen=max_errors)
        self._lock = threading.Lock()
        self._recent_window_s = recent_window_s
        self._total = 0

    def report_exception(
        self,
        module_name: str,
        work_context: str,
        exception: BaseException,
        severity: ErrorSeverity = ErrorSeverity.ERROR,
        details: dict[str, Any] | None = None,
    ) -> str:
        # an exception raised on another rank arrives with its type name and traceback
        type_name = getattr(exception, "type_name", type(exception).__name__)
        tb = getattr(exception, "remote_traceback", "") or "".join(
            traceback.format_exception(type(exception), exception, exception.__traceback__)
        )
        message = str(exception) if hasattr(exception, "type_name") else f"{type_name}: {exception}"
        return self._add(module_name, work_context, message, severity, details, type_name, tb)

    def report_error(
        self,
        module_name: str,
        work_context: str,
        message: str,
        severity: ErrorSeverity = ErrorSeverity.ERROR,
        details: dict[str, Any] | None = None,
    ) -> str:
        return self._add(module_name, work_context, message, severity, details, None, None)

    def _add(
        self,
        module_name: str,
        work_context: str,
        message: str,
        severity: ErrorSeverity,
        details: dict[str, Any] | None,
        exc_type: str | None,
        tb: str | None,
    ) -> str:
        info = ErrorInfo(
            error_id=uuid.uuid4().hex[:12],
            timestamp=time.time(),
            module_name=module_name,
            work_context=work_context,
            severity=severity,
            message=message,
            details=dict(details or {}),
            exception_type=exc_type,
            exception_traceback=tb,
        )
        with self._lock:
            self._errors.append(info)
            self._total += 1
        return info.error_id

    def errors(self, severity: ErrorSeverity | None = None) -> list[ErrorInfo]:
        with self._lock:
            items = list(self._errors)
        return [e for e in items if severity is None or e.severity == severity]

    def errors_since(self, seen: int) -> tuple[list[ErrorInfo], int]:
        """Reports made after the first ``seen`` ones (as many as are still kept) and the new total."""
        with self._lock:
            total = self._total
            fresh = min(total - seen, len(self._errors))
            return (list(self._errors)[len(self._errors) - fresh :] if fresh > 0 else []), total

    def get_health_status(self) -> dict[str, Any]:
        cutoff = time.time() - self._recent_window_s
        with self._lock:
            recent = [e for e in self._errors if e.timestamp >= cutoff]
        n_error = sum(e.severity == ErrorSeverity.ERROR for e in recent)
        n_warning = sum(e.severity == ErrorSeverity.WARNING for e in recent)
        if n_error:
            status, message = "error", f"{n_error} error(s) in the last {self._recent_window_s:.0f}s"
        elif n_warning:
            status, message = "warning", f"{n_warning} warning(s) in the last {self._recent_window_s:.0f}s"
        else:
            status, message = "healthy", "no recent errors"
        return {
            "status": status,
            "message": message,
            "recent_error_count": len(recent),
            "error_level_count": n_error,
            "warning_level_count": n_warning,
        }
