"""Value types and serializers: Spark DDL strings or pyarrow types, with pickle as the fallback.

A typed state stores its values as MessagePack of a plain-value form of the declared type
(dates as days, timestamps as microseconds, decimals as unscaled integers, structs as lists in
field order). That form is compact, identical across processes and Python versions, checked
against the type on every write, and maps one-to-one to an Arrow column for canonical savepoints
and the state processor API. The untyped fallback pickles values; pickled bytes are only ever
read back from storage the job itself wrote (pickle executes code when it loads).

One idea a module: :mod:`.ddl` (Spark DDL -> pyarrow), :mod:`.converters` (plain-value
converters per Arrow type), :mod:`.serializers` (the serializers), :mod:`.type_strings` (the
types a snapshot records), :mod:`.namespaces` (namespace bytes). Import from here:
``from keyedstate.serde import X`` is the stable path, and the serializer classes keep
``keyedstate.serde`` as their module, so the RocksDB meta file pickles them under the same
name as before the split.
"""

from keyedstate.serde.converters import (
    EPOCH,
    EPOCH_DATE,
    Decode,
    Encode,
    converters,
    datetime_to_micros,
    micros_to_datetime,
)
from keyedstate.serde.ddl import TypeLike, parse_type, to_arrow_schema, type_ddl
from keyedstate.serde.namespaces import (
    VOID_NAMESPACE,
    deserialize_namespace,
    serialize_namespace,
)
from keyedstate.serde.serializers import (
    ArrowTypeSerializer,
    PickleSerializer,
    TypeSerializer,
    one_call_codec,
    serializer_for,
)
from keyedstate.serde.type_strings import serializer_from_string, type_from_string

__all__ = [
    "EPOCH",
    "EPOCH_DATE",
    "VOID_NAMESPACE",
    "ArrowTypeSerializer",
    "Decode",
    "Encode",
    "PickleSerializer",
    "TypeLike",
    "TypeSerializer",
    "converters",
    "datetime_to_micros",
    "deserialize_namespace",
    "micros_to_datetime",
    "one_call_codec",
    "parse_type",
    "serialize_namespace",
    "serializer_for",
    "serializer_from_string",
    "to_arrow_schema",
    "type_ddl",
    "type_from_string",
]
