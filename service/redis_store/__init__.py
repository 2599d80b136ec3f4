"""The Redis ``Store``: one Redis or a Redis Cluster, shared by every service replica.

:class:`RedisStore` (:mod:`.store`) is the entry point; its Lua scripts are ``scripts/*.lua``
(:mod:`.lua`).
"""

from .store import RedisStore

__all__ = ["RedisStore"]
