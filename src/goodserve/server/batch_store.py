"""The batch API's durable state: files, batch jobs and each line's result, in SQLite under --data-dir.

A file's bytes live beside the database (DIR/files/<id>), its metadata in it. A batch job is its
OpenAI object as JSON; its request counts are counted from the lines table, where each line's result
is committed the moment it finishes (WAL, synchronous=NORMAL: a commit survives the process being
killed; an OS crash may lose the last few). A server started again on the same DIR therefore knows
exactly which lines are done. One connection, used by one thread: every method runs there and the
event loop awaits it, so a slow disk never stalls it. An exclusive lock on DIR keeps a second server
from running the same jobs.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from goodserve.errors import GoodserveError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, object TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
"""
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
_FILE_FIELDS = ("id", "filename", "purpose", "bytes", "created_at")
_FILE_COLUMNS = ", ".join(_FILE_FIELDS)


class DataDirInUseError(GoodserveError):
    http_status = 503
    error_type = "service_unavailable"


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/goodserve, else ~/.local/share/goodserve."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "goodserve"


def _in_db_thread(method):
    """The method runs on the store's database thread; the caller awaits it."""

    @functools.wraps(method)
    async def run(self: BatchStore, *args):
        return await asyncio.get_running_loop().run_in_executor(self.thread, functools.partial(method, self, *args))

    return run


class BatchStore:
    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.lock = open(self.data_dir / "goodserve.lock", "w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the OS when we die
        except BlockingIOError:
            self.lock.close()
            raise DataDirInUseError(f"{self.data_dir} is used by another goodserve server: "
                                    "give this one its own --data-dir") from None
        self.db = sqlite3.connect(self.data_dir / "batch.db", check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="goodserve-batch-db")

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.db.close()
        self.lock.close()

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    # ---- files ---------------------------------------------------------------------------
    @_in_db_thread
    def add_file(self, file: dict, content: bytes) -> None:
        self._write_file(file["id"], content)
        self._add_file_row("INSERT", file)

    @_in_db_thread
    def add_file_from(self, file: dict, path: Path) -> None:
        """A file written elsewhere in this store's folder (an upload, as it streamed in), moved into place."""
        os.replace(path, self.file_path(file["id"]))
        self._add_file_row("INSERT", file)

    def _add_file_row(self, verb: str, file: dict) -> None:
        self.db.execute(f"{verb} INTO files ({_FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                        tuple(file[name] for name in _FILE_FIELDS))

    def _write_file(self, file_id: str, content: bytes) -> None:
        partial = self.file_path(file_id).with_suffix(".partial")
        partial.write_bytes(content)
        os.replace(partial, self.file_path(file_id))

    @_in_db_thread
    def get_file(self, file_id: str) -> dict | None:
        return self._file_row(file_id)

    def _file_row(self, file_id: str) -> dict | None:
        row = self.db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else dict(zip(_FILE_FIELDS, row))

    @_in_db_thread
    def list_files(self) -> list[dict]:
        rows = self.db.execute(f"SELECT {_FILE_COLUMNS} FROM files ORDER BY created_at")
        return [dict(zip(_FILE_FIELDS, row)) for row in rows]

    @_in_db_thread
    def delete_file(self, file_id: str) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    @_in_db_thread
    def read_file(self, file_id: str) -> bytes:
        return self.file_path(file_id).read_bytes()

    @_in_db_thread
    def open_file(self, file_id: str) -> BinaryIO | None:
        """The file's bytes opened for reading, None if it is not (or no longer) here. On the database
        thread, as delete_file is: a file is either whole and open or deleted, never half of each."""
        if self._file_row(file_id) is None:
            return None
        try:
            return open(self.file_path(file_id), "rb")
        except FileNotFoundError:
            return None

    # ---- batches -------------------------------------------------------------------------
    @_in_db_thread
    def add_batch(self, batch: dict) -> None:
        self.db.execute("INSERT INTO batches (id, object) VALUES (?, ?)", (batch["id"], json.dumps(batch)))

    @_in_db_thread
    def save_batch(self, batch: dict) -> None:
        self.db.execute("UPDATE batches SET object = ? WHERE id = ?", (json.dumps(batch), batch["id"]))

    @_in_db_thread
    def get_batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else self._with_counts(json.loads(row[0]))

    @_in_db_thread
    def list_batches(self, limit: int, after: str | None) -> list[dict]:
        """Newest first; after: the id of the last batch of the previous page."""
        query, args = "SELECT object FROM batches", ()
        if after is not None:
            query, args = query + " WHERE seq < (SELECT seq FROM batches WHERE id = ?)", (after,)
        rows = self.db.execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit)).fetchall()
        return [self._with_counts(json.loads(row[0])) for row in rows]

    @_in_db_thread
    def unfinished_batches(self) -> list[dict]:
        rows = self.db.execute("SELECT object FROM batches ORDER BY seq").fetchall()
        return [b for b in (json.loads(row[0]) for row in rows) if b["status"] in UNFINISHED]

    @_in_db_thread
    def file_in_use(self, file_id: str) -> bool:
        """An unfinished batch reads this file."""
        rows = self.db.execute("SELECT object FROM batches").fetchall()
        return any(b["input_file_id"] == file_id and b["status"] in UNFINISHED
                   for b in (json.loads(row[0]) for row in rows))

    def _with_counts(self, batch: dict) -> dict:
        done = dict(self.db.execute("SELECT ok, COUNT(*) FROM batch_lines WHERE batch_id = ? GROUP BY ok",
                                    (batch["id"],)).fetchall())
        total = batch["request_counts"]["total"]
        batch["request_counts"] = {"total": total, "completed": done.get(1, 0), "failed": done.get(0, 0)}
        return batch

    # ---- lines ---------------------------------------------------------------------------
    @_in_db_thread
    def record_lines(self, batch_id: str, results: list[tuple[int, str | None, bool, dict]]) -> None:
        """(line number, custom_id, ok, output record) of finished lines, committed together."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT OR IGNORE INTO batch_lines (batch_id, line, custom_id, ok, record) VALUES (?, ?, ?, ?, ?)",
                [(batch_id, line, custom_id, int(ok), json.dumps(record)) for line, custom_id, ok, record in results])

    @_in_db_thread
    def done_lines(self, batch_id: str) -> set[int]:
        return {row[0] for row in self.db.execute("SELECT line FROM batch_lines WHERE batch_id = ?", (batch_id,))}

    @_in_db_thread
    def usage(self, batch_id: str) -> dict:
        """The tokens of the lines answered, as OpenAI's batch `usage`."""
        usage = "json_extract(record, '$.response.body.usage.{}')"
        prompt, completion, cached = self.db.execute(
            "SELECT " + ", ".join(f"COALESCE(SUM({usage.format(field)}), 0)" for field in (
                "prompt_tokens", "completion_tokens", "prompt_tokens_details.cached_tokens"))
            + " FROM batch_lines WHERE batch_id = ? AND ok = 1", (batch_id,)).fetchone()
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}

    @_in_db_thread
    def write_result_file(self, batch_id: str, ok: bool, file: dict) -> bool:
        """Write the lines that succeeded (ok) or failed, in input order, as a file; False if none did."""
        rows = self.db.execute("SELECT record FROM batch_lines WHERE batch_id = ? AND ok = ? ORDER BY line",
                               (batch_id, int(ok))).fetchall()
        if not rows:
            return False
        content = "".join(row[0] + "\n" for row in rows).encode()
        self._write_file(file["id"], content)
        self._add_file_row("INSERT OR REPLACE", {**file, "bytes": len(content)})  # a finalize run again
        return True
