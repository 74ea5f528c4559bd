"""State schema evolution: is a restored state's recorded type readable as the descriptor's type?

The rules of state schema evolution (``docs/schema-evolution.md`` is the reference), resolved
to one of Flink's three outcomes (``TypeSerializerSchemaCompatibility``):

* :attr:`SchemaCompatibility.COMPATIBLE_AS_IS`: the types are equal; old values are new values.
* :attr:`SchemaCompatibility.COMPATIBLE_AFTER_MIGRATION`: every old value has one value in the
  new type: struct fields added (nullable, or with a declared default), removed, reordered or
  renamed with a mapping; types widened losslessly (a wider integer, int8/16/32 to double, a
  wider float, date to timestamp, a nullable field where it was not null). Struct fields, list
  elements and map values evolve by the same rules, at any depth.
* :attr:`SchemaCompatibility.INCOMPATIBLE`: anything else (narrowing, string to bigint, a
  changed map key type, a field made not null, a new not-null field without a default, a
  possible rename nobody confirmed); the resolution carries the
  :class:`~keyedstate.errors.StateTypeMismatchError` to raise.

This module only resolves and migrates values (one Python value as the serde presents it,
:meth:`Resolution.migrate`; one plain MessagePack form, :attr:`Resolution.plain_migration`; or
one Arrow array, :meth:`Resolution.migrate_array`); restore applies it through
:mod:`keyedstate.backends.base.migration`. It stands on pyarrow types alone: turning a recorded
type string into a pyarrow type is the caller's business.

Field paths name a place in a value: struct fields joined with ``.`` (``profile.address.zip``),
``[]`` for a list's element (``visits[].page``), ``{}`` for a map's value and ``{key}`` for its
key (``scores{}.best``); the empty path is the value itself.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.errors import ConfigurationError, SerializationError, StateTypeMismatchError
from keyedstate.serde import converters

#: How to get past an incompatible change, said by every error this module builds.
WAY_OUT = ("keep the recorded type, rewrite the state into the new type with the state "
           "processor API (read the savepoint, transform, write a new one), or drop the state "
           "(a new state name starts empty)")

_KEY = "{key}"
_VALUE = "{}"
_ELEMENT = "[]"

MigrateValue = Callable[[Any], Any]
MigrateArray = Callable[[pa.Array], pa.Array]


class SchemaCompatibility(Enum):
    """Flink's ``TypeSerializerSchemaCompatibility`` outcomes, for a state's value type."""

    COMPATIBLE_AS_IS = "compatible as is"
    COMPATIBLE_AFTER_MIGRATION = "compatible after migration"
    INCOMPATIBLE = "incompatible"


@dataclass(frozen=True)
class Resolution:
    """The outcome of :func:`resolve_schema_compatibility` for one state.

    ``migrate`` turns one old value (as :func:`keyedstate.serde.converters` decodes it: a dict
    for a struct, a list, a dict for a map, int, float, date, datetime, ...) into the value of
    the new type; it returns new objects where the value changes and never mutates its
    argument. ``migrate_array`` does the same for an Arrow array of the old type. Both are the
    identity when compatible as is and raise ``error`` when incompatible.
    """

    state_name: str
    compatibility: SchemaCompatibility
    old_type: pa.DataType
    new_type: pa.DataType
    error: StateTypeMismatchError | None = None
    _migrate: MigrateValue | None = field(default=None, repr=False)
    _migrate_array: MigrateArray | None = field(default=None, repr=False)
    _migrate_plain: MigrateValue | None = field(default=None, repr=False)

    @property
    def plain_migration(self) -> MigrateValue | None:
        """The migration on the plain form (``serde.converters``: a struct is the list of its
        fields' plain values, in field order) when it is only a rearrangement: old plain value
        -> new plain value, to decode with the new type's converter without building the old
        value. None when values change (widening to double, date to timestamp, nested
        changes), or as is."""
        return self._migrate_plain

    @property
    def is_compatible(self) -> bool:
        return self.compatibility is not SchemaCompatibility.INCOMPATIBLE

    def raise_if_incompatible(self) -> None:
        """Raise :attr:`error` if the state can't be migrated."""
        if self.error is not None:
            raise self.error

    def migrate(self, value: Any) -> Any:
        """The new type's value of one old value (None stays None)."""
        self.raise_if_incompatible()
        return value if self._migrate is None else self._migrate(value)

    def migrate_array(self, array: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
        """An array of the new type holding the migrated values of ``array`` (of the old type)."""
        self.raise_if_incompatible()
        if self._migrate_array is None:
            return array
        if isinstance(array, pa.ChunkedArray):
            return pa.chunked_array([self._migrate_array(c) for c in array.chunks],
                                    type=self.new_type)
        return self._migrate_array(array)


class _Incompatible(Exception):
    """Raised inside the resolver; becomes the resolution's :class:`StateTypeMismatchError`."""

    def __init__(self, path: str, old: pa.DataType, new: pa.DataType, reason: str) -> None:
        super().__init__(reason)
        self.path, self.old, self.new, self.reason = path, old, new, reason


@dataclass(frozen=True)
class _Plan:
    """How values at one place migrate; ``None`` functions mean the identity."""

    value: MigrateValue | None
    array: MigrateArray | None
    #: False when the types differ even if values don't (e.g. a field made nullable).
    as_is: bool
    #: the same migration on the plain (MessagePack) form, where it is only a rearrangement
    #: (a struct whose kept fields' values don't change); None otherwise
    plain: MigrateValue | None = None


_AS_IS = _Plan(None, None, True)


def resolve_schema_compatibility(state_name: str, old: pa.DataType, new: pa.DataType,
                                 defaults: Mapping[str, Any] | None = None,
                                 renames: Mapping[str, str] | None = None) -> Resolution:
    """Resolve whether values recorded as ``old`` can be read as ``new`` (the descriptor's type).

    ``defaults`` maps the path of an added struct field to its value in migrated values (a
    Python value of the field's type; None is allowed for a nullable field). An entry also says
    the field is new, not a renamed one. ``renames`` maps the path of a field in ``new`` to the
    name of the field it was in ``old``, in the same struct. When one struct both loses and
    gains fields, the change may be a rename: it is incompatible unless every added field is
    in ``defaults`` or ``renames``, since guessing would silently drop or misplace data.

    Raises :class:`ConfigurationError` when ``defaults`` or ``renames`` name a field that is
    not added in ``new``, or a default does not fit its field's type; an incompatible change is
    not raised but returned, with its error.
    """
    resolver = _Resolver(dict(defaults or {}), dict(renames or {}))
    try:
        plan = resolver.resolve("", old, new)
    except _Incompatible as exc:
        where = f"field {exc.path!r}" if exc.path else "the value"
        error = StateTypeMismatchError(
            f"state {state_name!r} can't be restored with its new type: {where} was {exc.old}, "
            f"is now {exc.new}: {exc.reason}. To change it, {WAY_OUT}"
        )
        return Resolution(state_name, SchemaCompatibility.INCOMPATIBLE, old, new, error)
    unused = sorted((set(resolver.defaults) | set(resolver.renames)) - resolver.used)
    if unused:
        raise ConfigurationError(
            f"state {state_name!r}: {unused} name no field added to the type {new} "
            f"(defaults and renames are keyed by the new field's path, e.g. 'profile.zip')"
        )
    if plan.as_is and old == new:
        return Resolution(state_name, SchemaCompatibility.COMPATIBLE_AS_IS, old, new)
    return Resolution(state_name, SchemaCompatibility.COMPATIBLE_AFTER_MIGRATION, old, new,
                      None, plan.value, plan.array, plan.plain)


def resolve_state_compatibility(state_name: str, old_kind: str, new_kind: str,
                                old_type: pa.DataType, new_type: pa.DataType,
                                old_map_key_type: pa.DataType | None = None,
                                new_map_key_type: pa.DataType | None = None,
                                defaults: Mapping[str, Any] | None = None,
                                renames: Mapping[str, str] | None = None) -> Resolution:
    """:func:`resolve_schema_compatibility` of a whole state: its kind (``StateKind`` value)
    and a map state's key type never change; the value type evolves by the rules."""
    if old_kind != new_kind:
        reason = f"its kind was {old_kind}, is now {new_kind}"
    elif old_map_key_type != new_map_key_type:
        reason = (f"its map key type was {old_map_key_type}, is now {new_map_key_type}: a "
                  f"map's key type never changes")
    else:
        return resolve_schema_compatibility(state_name, old_type, new_type, defaults, renames)
    error = StateTypeMismatchError(
        f"state {state_name!r} can't be restored with its new descriptor: {reason}. To change "
        f"it, {WAY_OUT}")
    return Resolution(state_name, SchemaCompatibility.INCOMPATIBLE, old_type, new_type, error)


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Resolver:
    def __init__(self, defaults: dict[str, Any], renames: dict[str, str]) -> None:
        self.defaults = defaults
        self.renames = renames
        self.used: set[str] = set()

    def resolve(self, path: str, old: pa.DataType, new: pa.DataType) -> _Plan:
        if old == new:
            return _AS_IS
        if pa.types.is_struct(old) and pa.types.is_struct(new):
            return self._struct(path, old, new)
        if _is_list(old) and _is_list(new):
            return self._list(path, old, new)
        if pa.types.is_map(old) and pa.types.is_map(new):
            return self._map(path, old, new)
        return _widen(path, old, new)

    # Step 1 of a struct: match every new field to an old one (same name, or renamed),
    # or to its default; then refuse what can't be told apart from a rename.
    def _struct(self, path: str, old: pa.StructType, new: pa.StructType) -> _Plan:
        old_fields = {old.field(i).name: old.field(i) for i in range(old.num_fields)}
        new_fields = [new.field(i) for i in range(new.num_fields)]
        sources: list[tuple[str, pa.Field, str | None, _Plan]] = []  # name, field, old name
        fills: dict[str, Any] = {}  # new name -> plain default (None: null)
        matched: set[str] = set()
        unconfirmed: list[pa.Field] = []  # added nullable fields with no default
        for f in new_fields:
            fpath = _child(path, f.name)
            source = self.renames.get(fpath, f.name if f.name in old_fields else None)
            if fpath in self.renames:
                self.used.add(fpath)
                if source not in old_fields:
                    raise ConfigurationError(
                        f"field {fpath!r} is renamed from {source!r}, which {old} does not have")
            if source is not None:
                before = old_fields[source]
                plan = self._resolve_member(
                    fpath, before, f, "the field is now not null and old values may be null")
                if before.nullable != f.nullable or source != f.name:
                    plan = _Plan(plan.value, plan.array, False)
                sources.append((f.name, f, source, plan))
                matched.add(source)
                continue
            # Step 2: an added field.
            if fpath in self.defaults:
                self.used.add(fpath)
                fills[f.name] = self._default(fpath, f, self.defaults[fpath])
            elif f.nullable:
                unconfirmed.append(f)
                fills[f.name] = None
            else:
                raise _Incompatible(
                    fpath, pa.null(), f.type,
                    "the field is added as not null without a default: declare it nullable or "
                    "give its default (defaults={'" + fpath + "': ...})")
            sources.append((f.name, f, None, _AS_IS))
        # Step 3: a struct that loses some fields and gains others may have renamed one.
        removed = [n for n in old_fields if n not in matched]
        if removed and unconfirmed:
            raise _Incompatible(
                _child(path, unconfirmed[0].name), old_fields[removed[0]].type,
                unconfirmed[0].type,
                f"field(s) {[_child(path, n) for n in removed]} removed and "
                f"{[_child(path, f.name) for f in unconfirmed]} added "
                f"may be a rename: pass renames={{new path: old name}} for a rename, or "
                f"defaults={{new path: value or None}} for a new field")
        old_order = [old.field(i).name for i in range(old.num_fields)]
        new_order = [s[2] for s in sources]
        if (not removed and not fills and old_order == new_order
                and all(p.as_is for *_, p in sources)):
            return _AS_IS  # only equal up to metadata pyarrow compares
        return _Plan(_struct_value(sources, fills, new), _struct_array(sources, fills, new),
                     False, _struct_plain(sources, fills, old_order))

    def _resolve_member(self, path: str, old: pa.Field, new: pa.Field, not_null: str
                        ) -> _Plan:
        """The plan of one member of a container (a struct field, a list's element, a map's
        value) that both types have: refused with ``not_null`` as the reason when it was
        nullable and is no longer (old values may be null), else resolved by the rules."""
        if old.nullable and not new.nullable:
            raise _Incompatible(path, old.type, new.type, not_null)
        return self.resolve(path, old.type, new.type)

    def _default(self, fpath: str, f: pa.Field, default: Any) -> Any:
        if default is None:
            if not f.nullable:
                raise ConfigurationError(f"the default of not-null field {fpath!r} is None")
            return None
        encode, _ = converters(f.type)
        try:
            return encode(default)
        except SerializationError as exc:
            raise ConfigurationError(f"the default of field {fpath!r}: {exc}") from exc

    def _list(self, path: str, old: pa.DataType, new: pa.DataType) -> _Plan:
        if type(old) is not type(new):
            raise _Incompatible(path, old, new, "list and large_list don't convert")
        o, n = old.value_field, new.value_field
        plan = self._resolve_member(path + _ELEMENT, o, n, "elements are now not null")
        return _Plan(_list_value(plan.value), _list_array(plan.array, new), False)

    def _map(self, path: str, old: pa.MapType, new: pa.MapType) -> _Plan:
        if old.key_type != new.key_type:
            raise _Incompatible(path + _KEY, old.key_type, new.key_type,
                                "a map's key type never changes (keys would collide or reorder)")
        o, n = old.item_field, new.item_field
        plan = self._resolve_member(path + _VALUE, o, n, "map values are now not null")
        return _Plan(_map_value(plan.value), _map_array(plan.array, new), False)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _int_range(t: pa.DataType) -> tuple[int, int]:
    bits = t.bit_width
    return (-(1 << bits - 1), 1 << bits - 1) if pa.types.is_signed_integer(t) else (0, 1 << bits)


def _widen(path: str, old: pa.DataType, new: pa.DataType) -> _Plan:
    """The plan of a change of a primitive type: lossless widening only."""
    cast = _cast_to(new)
    if pa.types.is_integer(old) and pa.types.is_integer(new):
        (olo, ohi), (nlo, nhi) = _int_range(old), _int_range(new)
        if nlo <= olo and ohi <= nhi:
            return _Plan(None, cast, False)
        raise _Incompatible(path, old, new, "narrowing loses values")
    if pa.types.is_integer(old) and pa.types.is_float64(new):
        # A double holds every integer up to 2**53 exactly: int64 values beyond would round.
        if old.bit_width <= 32:
            return _Plan(_optional(float), cast, False)
        raise _Incompatible(path, old, new, "a double can't hold every 64-bit integer exactly")
    if pa.types.is_floating(old) and pa.types.is_floating(new):
        if old.bit_width < new.bit_width:
            return _Plan(None, cast, False)
        raise _Incompatible(path, old, new, "narrowing loses precision")
    if pa.types.is_date32(old) and pa.types.is_timestamp(new):
        aware = new.tz is not None
        return _Plan(_optional(lambda d: _dt.datetime(d.year, d.month, d.day,
                                                      tzinfo=_dt.timezone.utc if aware else None)),
                     cast, False)
    raise _Incompatible(path, old, new, "the type changed and only lossless widening migrates")


def _optional(fn: Callable[[Any], Any]) -> MigrateValue:
    return lambda v: None if v is None else fn(v)


def _cast_to(new: pa.DataType) -> MigrateArray:
    return lambda a: pc.cast(a, new)


# --------------------------------------------------------------------------------------------
# migrations of containers, one value and one array
# --------------------------------------------------------------------------------------------

_Source = tuple[str, pa.Field, str | None, _Plan]


def _struct_value(sources: list[_Source], fills: dict[str, Any],
                  new: pa.StructType) -> MigrateValue:
    # The hot path of lazy migration (one call per old value read): a template dict in the
    # new field order holds the defaults of scalar type (immutable, shared); fields copied as
    # they are, converted, or filled with a fresh nested default are set on a copy of it.
    template: dict[str, Any] = {}
    fresh: list[tuple[str, Callable[[Any], Any], Any]] = []
    copied: list[tuple[str, str]] = []
    converted: list[tuple[str, str, MigrateValue]] = []
    for name, f, old_name, plan in sources:
        template[name] = None
        if old_name is None:
            decode = converters(f.type)[1]
            if pa.types.is_nested(f.type):
                # Decoded per value: a struct or list default is a fresh object each time.
                fresh.append((name, decode, fills[name]))
            else:
                template[name] = decode(fills[name])
        elif plan.value is None:
            copied.append((name, old_name))
        else:
            converted.append((name, old_name, plan.value))

    def migrate(v: Any) -> Any:
        if v is None:
            return None
        out = template.copy()
        get = v.get
        for name, old_name in copied:
            out[name] = get(old_name)
        for name, old_name, fn in converted:
            x = get(old_name)
            out[name] = None if x is None else fn(x)
        for name, decode, fill in fresh:
            out[name] = decode(fill)
        return out
    return migrate


def _struct_plain(sources: list[_Source], fills: dict[str, Any],
                  old_order: list[str]) -> MigrateValue | None:
    """The struct's migration on plain lists, when no kept field's value changes: each new
    field takes the old list's item at its source's position, or its plain default."""
    if any(old_name is not None and plan.value is not None
           for _, _, old_name, plan in sources):
        return None
    position = {name: i for i, name in enumerate(old_order)}
    layout = [(position[old_name], None) if old_name is not None else (-1, fills[name])
              for name, _, old_name, _ in sources]
    nested = any(isinstance(fill, (list, dict)) for i, fill in layout if i < 0)
    kept = [i for i, _ in layout if i >= 0]
    if kept == list(range(len(old_order))) and all(i < 0 for i, _ in layout[len(kept):]):
        # Fields only appended (the common evolution): one list concatenation, at C speed.
        tail = [fill for _, fill in layout[len(kept):]]
        if nested:  # a nested default is copied per value, never shared
            return lambda v: None if v is None else v + _plain_copy(tail)
        return lambda v: None if v is None else v + tail

    def migrate(v: Any) -> Any:
        if v is None:
            return None
        return [v[i] if i >= 0 else _plain_copy(fill) if nested else fill
                for i, fill in layout]
    return migrate


def _plain_copy(plain: Any) -> Any:
    """A copy of a plain value's containers (a decoded default must not be shared)."""
    if isinstance(plain, list):
        return [_plain_copy(x) for x in plain]
    if isinstance(plain, dict):
        return {k: _plain_copy(x) for k, x in plain.items()}
    return plain


def _struct_array(sources: list[_Source], fills: dict[str, Any],
                  new: pa.StructType) -> MigrateArray:
    decode = {n: converters(new.field(n).type)[1] for n in fills}

    def migrate(a: pa.Array) -> pa.Array:
        # flatten() applies the struct's own nulls and offset to each child (field() doesn't).
        flat = a.flatten()
        children = []
        for name, f, old_name, plan in sources:
            if old_name is None:
                children.append(pa.array([decode[name](fills[name])] * len(a), type=f.type))
            else:
                child = flat[a.type.get_field_index(old_name)]
                children.append(child if plan.array is None else plan.array(child))
        mask = a.is_null() if a.null_count else None
        return pa.StructArray.from_arrays(children, fields=[s[1] for s in sources], mask=mask)
    return migrate


def _list_value(fn: MigrateValue | None) -> MigrateValue:
    def migrate(v: Any) -> Any:
        if v is None or fn is None:
            return v
        return [None if x is None else fn(x) for x in v]
    return migrate


def _list_array(fn: MigrateArray | None, new: pa.DataType) -> MigrateArray:
    def migrate(a: pa.Array) -> pa.Array:
        offsets, values = _rebased(a, a.values)
        cls = pa.ListArray if pa.types.is_list(new) else pa.LargeListArray
        mask = a.is_null() if a.null_count else None
        return cls.from_arrays(offsets, values if fn is None else fn(values), type=new, mask=mask)
    return migrate


def _map_value(fn: MigrateValue | None) -> MigrateValue:
    def migrate(v: Any) -> Any:
        if v is None or fn is None:
            return v
        return {k: None if x is None else fn(x) for k, x in v.items()}
    return migrate


def _map_array(fn: MigrateArray | None, new: pa.MapType) -> MigrateArray:
    def migrate(a: pa.Array) -> pa.Array:
        offsets, items = _rebased(a, a.items)
        _, keys = _rebased(a, a.keys)
        mask = a.is_null() if a.null_count else None
        return pa.MapArray.from_arrays(offsets, keys, items if fn is None else fn(items),
                                       type=new, mask=mask)
    return migrate


def _rebased(a: pa.Array, child: pa.Array) -> tuple[pa.Array, pa.Array]:
    """Offsets from 0 and the part of ``child`` they cover. A sliced list or map array keeps
    offsets into its whole child, and Arrow can't rebuild one from sliced offsets and nulls."""
    offsets = a.offsets
    start, end = offsets[0].as_py(), offsets[-1].as_py()
    return pc.subtract(offsets, pa.scalar(start, offsets.type)), child.slice(start, end - start)


def field_paths(type_: pa.DataType, path: str = "") -> set[str]:
    """The paths of every struct field in ``type_`` at any depth (the module's path syntax),
    e.g. ``{"profile", "profile.zip", "visits[].page"}``."""
    paths: set[str] = set()
    if pa.types.is_struct(type_):
        for i in range(type_.num_fields):
            f = type_.field(i)
            child = _child(path, f.name)
            paths.add(child)
            paths |= field_paths(f.type, child)
    elif _is_list(type_):
        paths |= field_paths(type_.value_type, path + _ELEMENT)
    elif pa.types.is_map(type_):
        paths |= field_paths(type_.item_type, path + _VALUE)
    return paths


@dataclass(frozen=True)
class SchemaEvolution:
    """How a descriptor's type evolves from the type its state was recorded with: the
    ``defaults`` of added fields and the ``renames`` of renamed ones, keyed by the field's
    path in the new type (see :func:`resolve_schema_compatibility`). Give it to the
    descriptor (``ValueStateDescriptor(..., evolution=SchemaEvolution(defaults={...}))``) and
    keep it: entries about fields the recorded type already has are ignored, so a descriptor
    may carry the defaults of every evolution it went through; an entry naming a path the new
    type does not have is refused (a typo would silently fill nulls)."""

    defaults: Mapping[str, Any] = field(default_factory=dict)
    renames: Mapping[str, str] = field(default_factory=dict)

    def resolve(self, state_name: str, old: pa.DataType, new: pa.DataType) -> Resolution:
        """:func:`resolve_schema_compatibility` with the entries of this step: those naming a
        path of ``new`` that ``old`` lacks."""
        new_paths, old_paths = field_paths(new), field_paths(old)
        unknown = sorted(p for p in {*self.defaults, *self.renames} if p not in new_paths)
        if unknown:
            raise ConfigurationError(
                f"state {state_name!r}: the evolution names {unknown}, which the type {new} "
                f"does not have (defaults and renames are keyed by the new field's path, "
                f"e.g. 'profile.zip')")
        return resolve_schema_compatibility(
            state_name, old, new,
            {p: v for p, v in self.defaults.items() if p not in old_paths},
            {p: v for p, v in self.renames.items() if p not in old_paths})
