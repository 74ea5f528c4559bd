"""State access overhead: get + update through ValueState against raw rocksdict.

Both sides do the same work per key: read the counter, add one, write it back, with the key's
bytes and value encoding. The raw side keeps precomputed key bytes and uses struct-packed
values; ours goes through ``set_current_key`` (key group precomputed, as the Spark runtime
passes it) and a typed ``bigint`` ValueState. The heap backend is listed for reference.
Goal (issue 2): at most 2x raw rocksdict.
"""

from __future__ import annotations

import struct
from typing import Any

from rocksdict import Options, Rdict

from benchmarks.common import machine, timed, user_keys, workdir
from keyedstate.backends import load_backend
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor

_pack = struct.Struct("<q").pack
_unpack = struct.Struct("<q").unpack


def _raw(keys: list[str], rounds: int, root: str) -> float:
    db = Rdict(f"{root}/raw", Options(raw_mode=True))
    encoded = [k.encode() for k in keys]
    try:
        with timed() as t:
            for _ in range(rounds):
                for k in encoded:
                    v = db.get(k)
                    db.put(k, _pack((0 if v is None else _unpack(v)[0]) + 1))
        return t.seconds
    finally:
        db.close()


def _ours(backend_name: str, keys: list[str], rounds: int, root: str) -> float:
    ks = KeySerializer(["string"])
    routed = [(k, ks.key_group(k, 128)) for k in keys]
    sub = load_backend(backend_name).create_keyed_backend(
        subtask_index=0, key_group_range=KeyGroupRange(0, 127), max_parallelism=128,
        key_serializer=ks, local_dir=f"{root}/{backend_name}")
    with sub:
        state = sub.get_state(ValueStateDescriptor("count", "bigint", default=0))
        with timed() as t:
            for _ in range(rounds):
                for key, kg in routed:
                    sub.set_current_key(key, kg)
                    state.update(state.value() + 1)
        return t.seconds


def run(keys: int = 200_000, rounds: int = 3, progress: Any = None) -> dict[str, Any]:
    ks = user_keys(keys)
    with workdir("access") as root:
        if progress:
            progress("access: raw rocksdict")
        raw = _raw(ks, rounds, root)
        if progress:
            progress("access: keyedstate rocksdb")
        rocks = _ours("rocksdb", ks, rounds, root)
        if progress:
            progress("access: keyedstate heap")
        heap = _ours("heap", ks, rounds, root)
    ops = keys * rounds
    return {
        "benchmark": "access",
        "machine": machine(),
        "goal": "keyedstate rocksdb get+update at most 2x raw rocksdict",
        "operations": ops,
        "raw_rocksdict_us_per_op": raw / ops * 1e6,
        "keyedstate_rocksdb_us_per_op": rocks / ops * 1e6,
        "keyedstate_heap_us_per_op": heap / ops * 1e6,
        "rocksdb_over_raw": rocks / raw,
        "heap_over_raw": heap / raw,
        "goal_met": rocks / raw <= 2.0,
    }
