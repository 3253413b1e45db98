"""Training from Spark: ``hvdmx.spark.run`` runs a function on ranks placed in
the tasks of a barrier-mode Spark stage, the rendezvous served by the
driver (docs/spark.md).

    import hvdmx.spark
    results = hvdmx.spark.run(train, args=(lr,), num_proc=4)          # rank order
    hvdmx.spark.run(train, num_proc=4, data=df)   # each rank gets its share of df:
    # in train: x, y = hvdmx.spark.rank_arrays("features", "label")

Importing this package imports neither pyspark nor MXNet: ``run`` imports
pyspark when called (and says what to install when it is missing), the
rank-side helpers import MXNet only for ``rank_dataset``.
"""
from hvdmx.spark.data import DATA_VARIABLE, rank_arrays, rank_data, rank_dataset
from hvdmx.spark.driver import run

__all__ = ["run", "rank_data", "rank_arrays", "rank_dataset", "DATA_VARIABLE"]
