"""The state processor, engine-independent: canonical savepoints (schema, layout, writer and
reader) and inspection of checkpoint directories (list, show, sizes, garbage). The Spark
DataFrame API over it is :mod:`keyedstate.spark.processor`."""
