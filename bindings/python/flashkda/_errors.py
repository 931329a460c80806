# SPDX-License-Identifier: MIT
from ._abi import Status


class FlashKDAError(Exception):
    """A failing flashkda call.

    `status` is the library's fkda_status (a `Status` member), or None when the
    library itself could not be loaded. `message` is fkda_last_error()'s text,
    or the binding's own text for mistakes it catches before calling the
    library (they name the argument the same way and carry
    Status.INVALID_ARGUMENT).
    """

    def __init__(self, status, message, status_text=None):
        if status is not None:
            try:
                status = Status(status)
            except ValueError:
                status = int(status)
        self.status = status
        self.message = message
        self.status_text = status_text
        super().__init__(status, message)

    def __str__(self):
        if self.status is None:
            return self.message
        text = self.status_text or (
            self.status.name.lower().replace("_", " ")
            if isinstance(self.status, Status)
            else "unknown status"
        )
        return f"{self.message} [status {int(self.status)}: {text}]"


def invalid_argument(message):
    return FlashKDAError(Status.INVALID_ARGUMENT, message)
