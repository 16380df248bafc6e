"""The front end: requests in, outputs out (Engine, AsyncEngine, the engine process, admission)."""
