"""Test machinery shipped with keyedstate: the fault-injecting filesystem
(:mod:`~keyedstate.testing.faults`), the latency-shaping filesystem of the benchmarks
(:mod:`~keyedstate.testing.latency`), the local S3 server (:mod:`~keyedstate.testing.s3`) and
the chaos soak (:mod:`~keyedstate.testing.chaos`). The library never imports it."""
