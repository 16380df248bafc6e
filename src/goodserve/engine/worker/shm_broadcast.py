"""One writer, N readers, on one host: a ring of fixed-size slots in shared memory, each message
pickled and read by every reader in order (vLLM's shm MessageQueue is the model). It carries the
engine's step messages from rank 0 to the tensor-parallel ranks of its host: a gloo broadcast costs
two collectives over TCP a message, this a pickle, a copy and a flag.

A slot: a `written` byte, a read byte per reader, the message's length, then up to `slot_bytes` of
its pickle. A message longer than a slot takes as many slots as it needs, in turn (the readers
free them as they go, so it may be longer than the whole ring). The writer takes a slot once every
reader has read it; a reader reads a slot once it is written and its own byte is clear. The writer
writes the payload before it clears the read bytes, and x86's stores land in program order, so a
reader that sees its byte clear sees the payload.

Waiting spins (yielding the core) for a while, then sleeps in short naps, so an idle server costs
nothing and a busy one gets its message within microseconds; a waiter that the `alive` check fails
raises instead of waiting for a peer that is gone.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
from collections.abc import Callable
from multiprocessing import shared_memory

_LENGTH = struct.Struct("<Q")
_CLOSED = 2**64 - 1  # the length that says the writer closed the ring
SPIN_S = 0.01  # waits shorter than a few decode steps spin
NAP_S = 0.0005
ALIVE_CHECK_S = 1.0


class RingClosed(EOFError):
    pass


class _Ring:
    def __init__(self, shm: shared_memory.SharedMemory, num_readers: int, num_slots: int, slot_bytes: int) -> None:
        self.shm, self.num_readers, self.num_slots, self.slot_bytes = shm, num_readers, num_slots, slot_bytes
        self.meta_bytes = -(-(1 + num_readers) // 8) * 8
        self.stride = self.meta_bytes + _LENGTH.size + slot_bytes
        self.buf = shm.buf
        self.next = 0  # the slot this end uses next

    @staticmethod
    def size(num_readers: int, num_slots: int, slot_bytes: int) -> int:
        return num_slots * (-(-(1 + num_readers) // 8) * 8 + _LENGTH.size + slot_bytes)

    def offset(self) -> int:
        return self.next * self.stride

    def advance(self) -> None:
        self.next = (self.next + 1) % self.num_slots

    def close(self) -> None:
        del self.buf  # the mapping closes only once no view of it is left
        self.shm.close()


class Writer:
    """Makes the ring; readers attach by `name` (handles(): what to pass them)."""

    def __init__(self, num_readers: int, num_slots: int = 16, slot_bytes: int = 256 << 10,
                 alive: Callable[[], bool] = lambda: True) -> None:
        shm = shared_memory.SharedMemory(create=True, size=_Ring.size(num_readers, num_slots, slot_bytes))
        shm.buf[:] = bytes(shm.size)
        self.ring = _Ring(shm, num_readers, num_slots, slot_bytes)
        self.name = shm.name
        self.alive = alive  # whether the readers may still read

    def handle(self) -> tuple[str, int, int, int]:
        ring = self.ring
        return self.name, ring.num_readers, ring.num_slots, ring.slot_bytes

    def unlink(self) -> None:
        """Remove the name once every reader has attached: the memory lives while it is mapped, and
        no process's death leaves it behind."""
        self.ring.shm.unlink()

    def enqueue(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._write(len(data), memoryview(data))

    def close(self) -> None:
        """Tell the readers (each raises RingClosed once it reaches this), then unmap."""
        self._write(_CLOSED, memoryview(b""))
        self.ring.close()

    def _write(self, length: int, data: memoryview) -> None:
        ring, buf = self.ring, self.ring.buf
        n, read_all = ring.num_readers, b"\x01" * ring.num_readers
        start = 0
        while True:
            at = ring.offset()
            _wait(lambda: buf[at] == 0 or bytes(buf[at + 1 : at + 1 + n]) == read_all, self.alive)
            chunk = data[start : start + ring.slot_bytes]
            payload = at + ring.meta_bytes + _LENGTH.size
            _LENGTH.pack_into(buf, at + ring.meta_bytes, length)
            buf[payload : payload + len(chunk)] = chunk
            buf[at + 1 : at + 1 + n] = bytes(n)  # publishes the slot (its payload is written)
            buf[at] = 1
            ring.advance()
            start += ring.slot_bytes
            if start >= len(data):
                return


class Reader:
    def __init__(self, handle: tuple[str, int, int, int], index: int, alive: Callable[[], bool] = lambda: True) -> None:
        name, num_readers, num_slots, slot_bytes = handle
        # Attaching registers the name with the resource tracker that spawned processes share with
        # their parent, as the writer did: the writer's unlink() drops it for all.
        shm = shared_memory.SharedMemory(name=name)
        self.ring = _Ring(shm, num_readers, num_slots, slot_bytes)
        self.index = index
        self.alive = alive  # whether the writer may still write

    def dequeue(self):
        """The next message; RingClosed once the writer closed the ring."""
        ring, buf, mine = self.ring, self.ring.buf, 1 + self.index
        parts, length, got = [], None, 0
        while length is None or got < length:
            at = ring.offset()
            _wait(lambda: buf[at] == 1 and buf[at + mine] == 0, self.alive)
            (length,) = _LENGTH.unpack_from(buf, at + ring.meta_bytes)
            if length == _CLOSED:
                raise RingClosed("the writer closed the ring")
            payload = at + ring.meta_bytes + _LENGTH.size
            size = min(ring.slot_bytes, length - got)
            parts.append(bytes(buf[payload : payload + size]))
            buf[at + mine] = 1
            ring.advance()
            got += size
        return pickle.loads(b"".join(parts))

    def close(self) -> None:
        self.ring.close()


def _wait(ready: Callable[[], bool], alive: Callable[[], bool]) -> None:
    if ready():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < SPIN_S:
        if ready():
            return
        os.sched_yield()
    checked = time.perf_counter()
    while not ready():
        time.sleep(NAP_S)
        if time.perf_counter() - checked > ALIVE_CHECK_S:
            if not alive():
                raise RingClosed("the other end of the ring is gone")
            checked = time.perf_counter()
