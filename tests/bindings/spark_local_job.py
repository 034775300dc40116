"""A Spark program in local mode, as a new user first tries mtrain.spark.run (run by test_spark_local.py)."""
import sys

from pyspark.sql import SparkSession

import mtrain.spark


def rank_and_sum(scale):
    import numpy as np

    import mtrain.ringreduce as rr
    rr.init()
    mine = np.arange(3, dtype=np.float64) + 10.0 * rr.rank() * scale
    return rr.rank(), rr.allreduce(mine, op=rr.Sum).tolist()


spark = SparkSession.builder.master("local[2]").appName("mtrain-local").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
try:
    print("RESULTS", mtrain.spark.run(rank_and_sum, args=(int(sys.argv[1]),), num_proc=2, start_timeout=120),
          flush=True)
finally:
    spark.stop()
