"""The release, in a module of its own: the server and the router report it without the package's API."""

__version__ = "0.1.0"
