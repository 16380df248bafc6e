"""Admission control: a bounded waiting queue, so overload is a fast 429 instead of a slow timeout.

"Waiting" means admitted to the engine but not yet producing tokens. The server counts these
itself (all on the event loop, so no locking and no lag behind the engine thread's stats), in
sequences: a request with 50 prompts and n=128 takes 6,400 places, as it makes 6,400 sequences.
"""

from __future__ import annotations

from goodserve.errors import InvalidRequestError, QueueFullError


class QueueFull(QueueFullError):
    def __init__(self, max_waiting: int, retry_after_s: int):
        super().__init__(
            f"the server's waiting queue is full ({max_waiting} sequences); retry in {retry_after_s}s"
        )
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, max_waiting: int, retry_after_s: int = 1):
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.num_waiting = 0

    def admit(self, num_seqs: int) -> None:
        """Reserve queue places for one API call's sequences (prompts x n), or refuse them all."""
        if num_seqs > self.max_waiting:
            raise InvalidRequestError(
                f"this request makes {num_seqs} sequences (prompts x n), more than the waiting queue "
                f"holds (--max-waiting {self.max_waiting}): send fewer prompts or a smaller n"
            )
        if self.num_waiting + num_seqs > self.max_waiting:
            raise QueueFull(self.max_waiting, self.retry_after_s)
        self.num_waiting += num_seqs

    def started(self, num_seqs: int) -> None:
        """Sequences that produced their first output (or ended) leave the queue."""
        self.num_waiting -= num_seqs
