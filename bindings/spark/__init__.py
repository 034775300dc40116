"""mtrain on Spark: `mtrain.spark.run(fn, ...)` runs `fn` as an mtrain job inside the tasks of
the active Spark application and returns every rank's result, in rank order (Horovod's
`horovod.spark.run`; see docs/spark.md).  Needs `pip install 'mtrain[spark]'` and Java 17+.

Importing this package does not import pyspark; `run` says in one line what is missing.
"""
from mtrain.launcher.tasks.call_service import RankFailed
from mtrain.spark.runner import SparkRunError, run

__all__ = ["run", "RankFailed", "SparkRunError"]
