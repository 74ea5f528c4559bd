"""What the states and the timer service of a RocksDB keyed backend read of it: the one interface
between them, so that neither imports the keyed backend nor reads its private attributes.

:class:`~keyedstate.backends.rocksdb.keyed_backend.RocksDBKeyedStateBackend` implements it
with plain attributes (Flink's ``InternalKeyContext``, plus what a RocksDB state needs to
route by key group). A state reads :attr:`RocksDBKeyContext.key_prefix` on every access, so
it is an attribute, one lookup, never a computed property.
"""

from __future__ import annotations

from typing import Protocol

import rocksdict

from keyedstate.backends.rocksdb.instance import RocksDBInstance
from keyedstate.backends.rocksdb.value_cache import ValueCache
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.ttl import TtlTimeProvider


class RocksDBKeyContext(Protocol):
    """The current key of a keyed backend, its RocksDB instances, and the few services its
    states and timers share (the clock, write options, list sequence numbers)."""

    @property
    def key_prefix(self) -> bytes | None:
        """``[key group][varint len][key]`` of the current key (None: no current key); a new
        object on every key change, so a state notices with one identity check."""

    @property
    def current_instance(self) -> RocksDBInstance:
        """The instance of the current key (kept up to date only when :attr:`sharded`)."""

    @property
    def sharded(self) -> bool:
        """More than one instance: states and timers route by key group."""

    @property
    def current_key_bytes(self) -> bytes | None:
        """The canonical bytes of the current key (None: no current key)."""

    @property
    def current_key_group(self) -> int:
        """The key group of the current key."""

    @property
    def key_group_prefix_bytes(self) -> int:
        """How many bytes a stored key's key group takes (1 or 2)."""

    @property
    def instances(self) -> tuple[RocksDBInstance, ...]:
        """Every instance, in key-group order (fixed for the backend's life)."""

    @property
    def time_provider(self) -> TtlTimeProvider:
        """The clock of TTL."""

    @property
    def write_options(self) -> rocksdict.WriteOptions:
        """The options of every write (WAL off unless configured)."""

    @property
    def value_cache(self) -> ValueCache | None:
        """The value cache of the single-value states (None: off, every access goes to
        RocksDB)."""

    def instance_of(self, key_group: int) -> RocksDBInstance:
        """The instance owning ``key_group`` (which must be in the backend's range)."""

    def bulk_key_prefixes(self, keys: BatchKeys) -> list[bytes]:
        """:attr:`key_prefix` of each of ``keys``, built once per batch keys; checks their key
        groups against the backend's range first."""

    def bulk_shards(self, keys: BatchKeys) -> list[tuple[RocksDBInstance, list[int] | None]]:
        """The instances ``keys`` lie in, each with the positions of its keys (None: all of
        them, the one instance of an unsharded backend)."""

    def next_list_seq(self) -> int:
        """The next list element's sequence number (only grows, survives restore)."""
