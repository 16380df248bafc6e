"""A request's grammar compiled at admission: on a thread of its own, within a time bound.

xgrammar releases the GIL while it compiles, so a compile stalls neither the event loop nor an engine
on a thread of this process; it does take a core for its time. One thread: compiles queue behind
each other rather than take every core, and the tokenizer's threads stay free for prompts. Sizes are
bounded before this (structured_outputs.py); a grammar small enough that still takes longer than
COMPILE_TIMEOUT_S is a 400 (its compile finishes in the background, and its grammar is cached).
The engine takes the grammar compiled (engine/frontend/grammar.py, GrammarCompiler.serialized): one compile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from goodserve.errors import InvalidRequestError
from goodserve.structured_outputs import StructuredOutputsParams

COMPILE_TIMEOUT_S = 20.0


class GrammarCompiles:
    def __init__(self, compile_grammar: Callable[[StructuredOutputsParams], object],
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.compile_grammar = compile_grammar
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="goodserve-grammar")

    async def compile(self, spec: StructuredOutputsParams) -> None:
        """Compile spec (a cache hit after the first time), or raise a 400 past the time bound."""
        compiled = asyncio.get_running_loop().run_in_executor(self.pool, self.compile_grammar, spec)
        try:
            await asyncio.wait_for(compiled, self.timeout_s)
        except TimeoutError:
            raise InvalidRequestError(f"the grammar did not compile within {self.timeout_s:g} s: make it smaller "
                                      "or simpler") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
