"""The pyspark classes keyedstate's annotations name where classic Spark and Spark Connect
differ: for type checking only. Nothing imports this module at runtime (``from
keyedstate.spark.pyspark_types import Session`` under ``typing.TYPE_CHECKING``, with ``from
__future__ import annotations``), and it imports pyspark only under ``TYPE_CHECKING`` itself:
``keyedstate.spark`` keeps importing pyspark lazily, where it runs Spark.

A keyed job runs on a classic session or on a Spark Connect one (:mod:`keyedstate.spark.connect`).
A Connect DataFrame subclasses ``pyspark.sql.DataFrame``, so a DataFrame is annotated as that,
and a Spark ``Column``, ``Row`` or ``StructType`` as pyspark's own class. But Connect's
``SparkSession``, ``DataStreamWriter`` and ``StreamingQuery`` are classes of their own, not
subclasses of the classic ones: where either may come, the annotation is one of these unions.
Where only a classic session works (the state processor API, :func:`local_session
<keyedstate.spark.session.local_session>`), the annotation is ``pyspark.sql.SparkSession``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    from pyspark.sql import SparkSession as ClassicSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession
    from pyspark.sql.connect.streaming.query import StreamingQuery as ConnectStreamingQuery
    from pyspark.sql.connect.streaming.readwriter import (
        DataStreamWriter as ConnectDataStreamWriter,
    )
    from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

    #: A SparkSession keyedstate takes: classic, or Spark Connect's
    #: (``SparkSession.builder.remote("sc://...")``), which does not subclass the classic one.
    Session: TypeAlias = ClassicSession | ConnectSession
    #: A streaming DataFrame's ``writeStream``: classic, or Spark Connect's.
    StreamWriter: TypeAlias = DataStreamWriter | ConnectDataStreamWriter
    #: A started streaming query (``DataStreamWriter.start()``): classic, or Spark Connect's.
    Query: TypeAlias = StreamingQuery | ConnectStreamingQuery
