"""No cache: every step computes."""

from .base import Cache


class NoCache(Cache):
    active = False
    scoped = False


NONE = NoCache()
