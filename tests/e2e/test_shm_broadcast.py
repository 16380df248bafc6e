"""The shared-memory ring that carries step messages to the ranks of one host: every reader gets
every message in order, across the ring's wrap-around and for messages longer than a slot (or than
the whole ring), whatever the readers' pace; closing it ends every reader; a lost peer ends a wait."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from goodserve.engine.worker.shm_broadcast import Reader, RingClosed, Writer


def read_all(handle, index: int, delay: float, results) -> None:
    reader = Reader(handle, index)
    got = []
    try:
        while True:
            got.append(reader.dequeue())
            time.sleep(delay)
    except RingClosed:
        results.put((index, got))
    finally:
        reader.close()


def messages() -> list:
    """Small ones wrap the 4-slot ring many times; the long ones span 3 slots and 2.5 rings."""
    small = [{"step": i, "tokens": list(range(i % 7))} for i in range(40)]
    return small[:20] + [b"x" * 2500, "between"] + [bytes(range(256)) * 40] + small[20:]


@pytest.mark.parametrize("delays", [(0.0, 0.0), (0.0, 0.003), (0.003, 0.0)])
def test_every_reader_gets_every_message_in_order_at_its_own_pace(delays):
    context = multiprocessing.get_context("spawn")
    writer = Writer(num_readers=len(delays), num_slots=4, slot_bytes=1024)
    results = context.Queue()
    readers = [context.Process(target=read_all, args=(writer.handle(), i, delay, results))
               for i, delay in enumerate(delays)]
    for process in readers:
        process.start()
    try:
        for message in messages():
            writer.enqueue(message)
        writer.close()
        got = dict(results.get(timeout=300) for _ in readers)
    finally:
        writer.unlink()
        for process in readers:
            process.join(120)
    assert got == {i: messages() for i in range(len(delays))}


def test_a_reader_in_the_same_process_sees_a_long_message_and_the_close():
    writer = Writer(num_readers=1, num_slots=2, slot_bytes=64)
    reader = Reader(writer.handle(), 0)
    writer.unlink()
    writer.enqueue([1, 2, 3])
    assert reader.dequeue() == [1, 2, 3]
    writer.enqueue("a" * 100)  # two of the two slots
    assert reader.dequeue() == "a" * 100
    writer.close()
    with pytest.raises(RingClosed):
        reader.dequeue()
    reader.close()


def test_a_wait_for_a_peer_that_is_gone_ends(monkeypatch):
    monkeypatch.setattr("goodserve.engine.worker.shm_broadcast.ALIVE_CHECK_S", 0.05)
    writer = Writer(num_readers=1, num_slots=1, slot_bytes=64, alive=lambda: False)
    reader = Reader(writer.handle(), 0, alive=lambda: False)
    writer.unlink()
    with pytest.raises(RingClosed, match="gone"):
        reader.dequeue()  # nothing written: the writer is gone
    writer.enqueue(1)
    with pytest.raises(RingClosed, match="gone"):
        writer.enqueue(2)  # the only slot is unread: the reader is gone
    assert reader.dequeue() == 1
    reader.close()
    writer.ring.close()
