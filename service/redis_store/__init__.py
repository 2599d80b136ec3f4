"""The Redis ``Store``: one Redis or a Redis Cluster, shared by every service instance.

:class:`RedisStore` (:mod:`.store`) is the entry point. Beside it: :mod:`.keys`, the key
schema (every key, its type and what it holds); :mod:`.lua`, the Lua scripts
(``scripts/*.lua``, package data); :mod:`.feeds`, how followers learn of new versions;
:mod:`.cluster`, the Redis Cluster specifics (the client, the masters and their own
connections), with redis-py's one private class alone in :mod:`.command_table`; and
:mod:`.failures`, what a failed call becomes and how often one is retried.
"""

from .store import RedisStore

__all__ = ["RedisStore"]
