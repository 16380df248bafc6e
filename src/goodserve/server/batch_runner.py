"""Batch jobs through OpenAI's statuses: validating -> in_progress -> finalizing -> completed (or
failed, cancelling -> cancelled, expired), one asyncio task per job.

Validating parses the input file and records its malformed lines as errors; in progress runs the
other lines through batch_lines.run_lines (at most --batch-max-concurrency at once, lowest
priority), each line's result committed as it finishes; finalizing writes the output and error
files from those results. On start every unfinished job resumes where its committed lines end, so a
server killed mid-job redoes no finished line and loses none. A job past its expires_at
(completion_window after creation) stops taking lines: those not done go to the error file as
batch_expired.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from goodserve.server.batch_lines import BatchLine, BatchStopped, LineResult, parse_lines, run_lines
from goodserve.server.batch_store import BatchStore
from goodserve.server.metrics import ServerMetrics
from goodserve.server.serving import ServingContext

logger = logging.getLogger("goodserve.server")


class BatchRunner:
    def __init__(self, store: BatchStore, ctx: ServingContext, metrics: ServerMetrics, max_concurrency: int,
                 clock: Callable[[], float] = time.time):
        self.store, self.ctx, self.metrics = store, ctx, metrics
        self.max_concurrency = max_concurrency
        self.clock = clock
        self.jobs: dict[str, asyncio.Task] = {}

    async def resume(self) -> None:
        """Start every job a previous server left unfinished."""
        for batch in await self.store.unfinished_batches():
            logger.info("resuming batch %s (%s)", batch["id"], batch["status"])
            self.start(batch["id"])

    def start(self, batch_id: str) -> None:
        task = asyncio.create_task(self._run(batch_id))
        self.jobs[batch_id] = task
        task.add_done_callback(lambda done: self.jobs.pop(batch_id) if self.jobs.get(batch_id) is done else None)

    async def cancel(self, batch_id: str) -> dict:
        """Stop the job (its lines in flight are aborted), then finalize it as cancelled from the
        lines done so far. A job that already finished is left as it is."""
        task = self.jobs.get(batch_id)
        if task is not None:  # stopped first, so it saves nothing over the cancelling status
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        batch = await self.store.get_batch(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=self._now())
            await self.store.save_batch(batch)
        if batch["status"] == "cancelling":
            self.start(batch_id)
        return batch

    async def close(self) -> None:
        """Stop every job; unfinished lines run again when a server starts on the same --data-dir."""
        for task in list(self.jobs.values()):
            task.cancel()
        await asyncio.gather(*self.jobs.values(), return_exceptions=True)

    def _now(self) -> int:
        return int(self.clock())

    async def _run(self, batch_id: str) -> None:
        try:
            batch = await self.store.get_batch(batch_id)
            if batch["status"] in ("validating", "in_progress"):
                lines = await self._validated(batch)
                if lines is None:
                    return
                await self._run_lines(batch, lines)
            await self._finalize(batch)
        except BatchStopped as exc:
            logger.warning("batch %s paused: %s; it resumes on the next start", batch_id, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s failed", batch_id)
            batch = await self.store.get_batch(batch_id)
            await self._fail(batch, "internal_error", "the server failed running this batch; see its log")

    async def _validated(self, batch: dict) -> list[BatchLine] | None:
        """The input file's lines, its malformed ones recorded as errors; None if the batch failed."""
        data = await self.store.read_file(batch["input_file_id"])
        lines = await asyncio.to_thread(parse_lines, data, [batch["endpoint"]])
        if not lines:
            await self._fail(batch, "empty_file", "the input file has no lines")
            return None
        if batch["status"] == "validating":
            malformed = [line for line in lines if line.error]
            await self.store.record_lines(batch["id"], [
                (line.number, line.custom_id, False, line.error_record()) for line in malformed])
            for _ in malformed:
                self.metrics.observe_batch_line(False)
            batch.update(status="in_progress", in_progress_at=self._now())
            batch["request_counts"]["total"] = len(lines)
            await self.store.save_batch(batch)
        return lines

    async def _run_lines(self, batch: dict, lines: list[BatchLine]) -> None:
        done = await self.store.done_lines(batch["id"])
        pending = [line for line in lines if line.number not in done]

        async def record(result: LineResult) -> None:
            await self.store.record_lines(batch["id"], [(result.line.number, result.line.custom_id, result.ok,
                                                         result.record)])
            self.metrics.observe_batch_line(result.ok)

        await run_lines(self.ctx, pending, self.max_concurrency, record,
                        stopping=lambda: self.clock() >= batch["expires_at"])
        if self.clock() >= batch["expires_at"]:
            done = await self.store.done_lines(batch["id"])
            await self.store.record_lines(batch["id"], [
                (line.number, line.custom_id, False,
                 line.error_record("batch_expired", "the batch expired before this line ran"))
                for line in lines if line.number not in done])
            batch.update(status="expired", expired_at=self._now())

    async def _finalize(self, batch: dict) -> None:
        """Write the output and error files; the final status: completed, cancelled or expired."""
        final = {"in_progress": "completed", "finalizing": "completed", "cancelling": "cancelled"}.get(
            batch["status"], batch["status"])
        if batch["status"] == "in_progress":
            batch.update(status="finalizing", finalizing_at=self._now())
            await self.store.save_batch(batch)
        hex_id = batch["id"].removeprefix("batch_")
        for ok, key in ((True, "output_file_id"), (False, "error_file_id")):
            file = {"id": f"file-{hex_id}-{'output' if ok else 'errors'}", "filename": f"{batch['id']}_{key}.jsonl",
                    "purpose": "batch_output", "created_at": self._now()}
            if await self.store.write_result_file(batch["id"], ok, file):
                batch[key] = file["id"]
        batch["usage"] = await self.store.usage(batch["id"])
        batch["status"] = final
        batch[f"{final}_at"] = batch.get(f"{final}_at") or self._now()
        await self.store.save_batch(batch)
        logger.info("batch %s %s", batch["id"], final)

    async def _fail(self, batch: dict, code: str, message: str) -> None:
        batch.update(status="failed", failed_at=self._now(),
                     errors={"object": "list", "data": [{"code": code, "message": message}]})
        await self.store.save_batch(batch)
