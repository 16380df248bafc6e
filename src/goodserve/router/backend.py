"""One replica as the router sees it: its URL, health, and the load the router put on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Backend:
    url: str
    healthy: bool = True
    in_flight: int = 0  # requests this router sent that have not finished
    in_flight_chars: int = 0  # their prompts' length: a cheap stand-in for waiting tokens
    # The replica's own queue (goodserve:num_requests_running + _waiting) at the last scrape: it also
    # counts requests other routers or clients sent it. None: not scraped.
    scraped_requests: float | None = None
    # Set when the replica stops answering (its health check timed out or found no connection: a
    # frozen or vanished process): requests waiting for its response's headers stop waiting.
    silent: asyncio.Event = field(default_factory=asyncio.Event)
    relaying: set = field(default_factory=set)  # its responses being relayed (aiohttp.ClientResponse)

    @property
    def load(self) -> float:
        """Requests on the replica: the router's own count is exact for its traffic and never stale;
        the scrape, when newer traffic from elsewhere makes it larger, wins."""
        return max(self.in_flight, self.scraped_requests or 0)

    def started(self, prompt_chars: int) -> None:
        self.in_flight += 1
        self.in_flight_chars += prompt_chars

    def finished(self, prompt_chars: int) -> None:
        self.in_flight -= 1
        self.in_flight_chars -= prompt_chars
