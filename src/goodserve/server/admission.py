"""Admission control: a bounded waiting queue, so overload is a fast 429 instead of a slow timeout.

"Waiting" means admitted to the engine but not yet producing tokens. The server counts these
itself (all on the event loop, so no locking and no lag behind the engine thread's stats).
"""

from __future__ import annotations

from goodserve.errors import InvalidRequestError, QueueFullError


class QueueFull(QueueFullError):
    def __init__(self, max_waiting: int, retry_after_s: int):
        super().__init__(
            f"the server's waiting queue is full ({max_waiting} requests); retry in {retry_after_s}s"
        )
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, max_waiting: int, retry_after_s: int = 1):
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.num_waiting = 0

    def admit(self, num_requests: int) -> None:
        """Reserve queue places for one API call's engine requests, or refuse them all."""
        if num_requests > self.max_waiting:
            raise InvalidRequestError(
                f"{num_requests} prompts in one request exceed the waiting queue ({self.max_waiting})"
            )
        if self.num_waiting + num_requests > self.max_waiting:
            raise QueueFull(self.max_waiting, self.retry_after_s)
        self.num_waiting += num_requests

    def started(self, num_requests: int = 1) -> None:
        """Requests that produced their first output (or ended) leave the queue."""
        self.num_waiting -= num_requests
