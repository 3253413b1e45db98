"""A rank's share of the DataFrame given to ``hvdmx.spark.run(..., data=df)``.

The driver repartitions the DataFrame into one partition per rank (a
shuffle between executors: nothing is collected at the driver), and the
barrier stage maps over those partitions, so the task that starts a rank
holds that rank's rows. It writes them to a file of its host's temporary
directory (``write_share``: one NumPy array per column, an ``.npz``),
names the file to the rank in ``HVDMX_SPARK_DATA`` and removes it when the
rank has ended. In the rank, ``rank_data()`` reads the columns back,
``rank_arrays(*names)`` picks some, and ``rank_dataset(*names)`` makes an
MXNet ``ArrayDataset`` of them for a ``gluon.data.DataLoader``.

A column of numbers becomes a 1-D array; one of arrays (``ArrayType``) or
ML vectors (``pyspark.ml.linalg.Vector``) a 2-D array, one row per row
(every row's array the same length). Partitions may differ in size by a
row or so (``repartition`` deals rows round-robin): the ranks agree on how
many steps to run (docs/spark.md, "Unequal shares").
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import numpy as np

DATA_VARIABLE = "HVDMX_SPARK_DATA"
_ORDER = "__hvdmx_columns__"  # the .npz entry that keeps the columns' order


def _value(value: Any) -> Any:
    to_array = getattr(value, "toArray", None)  # pyspark.ml.linalg vectors
    return to_array() if callable(to_array) else value


def write_share(rows: Iterable[Any], columns: Sequence[str], path: str) -> int:
    """Writes `rows` (pyspark Rows of `columns`) to `path` as an .npz of one
    array per column; returns the number of rows."""
    values: List[List[Any]] = [[] for _ in columns]
    count = 0
    for row in rows:
        for index, name in enumerate(columns):
            values[index].append(_value(row[name]))
        count += 1
    arrays: Dict[str, np.ndarray] = {}
    for name, column in zip(columns, values):
        with warnings.catch_warnings():
            # numpy < 1.24 makes ragged rows an object array, with this warning.
            warnings.simplefilter("error", np.VisibleDeprecationWarning)
            try:
                arrays[name] = np.asarray(column)
            except (ValueError, np.VisibleDeprecationWarning):
                raise ValueError(f"hvdmx.spark.run: column {name!r} of data holds arrays of "
                                 "different lengths; give every row's array the same length "
                                 "(or select other columns)") from None
        if arrays[name].dtype == object:
            raise ValueError(f"hvdmx.spark.run: column {name!r} of data holds values that "
                             "are not numbers (or arrays of numbers); select numeric or "
                             "array columns")
    with open(path, "wb") as f:
        np.savez(f, **{_ORDER: np.asarray(list(columns))}, **arrays)
    return count


def rank_data() -> Dict[str, np.ndarray]:
    """This rank's rows of ``data``: {column: array}, in the DataFrame's
    column order. Only in a rank of ``hvdmx.spark.run(..., data=df)``."""
    path = os.environ.get(DATA_VARIABLE)
    if not path:
        raise RuntimeError(f"hvdmx.spark.rank_data: {DATA_VARIABLE} is not set: this "
                           "process is not a rank of hvdmx.spark.run(fn, ..., data=df); "
                           "pass the DataFrame as data=")
    with np.load(path, allow_pickle=False) as share:
        order = [str(name) for name in share[_ORDER]]
        return {name: share[name] for name in order}


def rank_arrays(*columns: str) -> Tuple[np.ndarray, ...]:
    """This rank's rows of the named columns (default: all), as arrays."""
    share = rank_data()
    names = list(columns) or list(share)
    missing = [name for name in names if name not in share]
    if missing:
        raise KeyError(f"hvdmx.spark.rank_arrays: no column {', '.join(map(repr, missing))} "
                       f"in data (its columns: {', '.join(share)})")
    return tuple(share[name] for name in names)


def rank_dataset(*columns: str) -> Any:
    """This rank's rows of the named columns (default: all) as an MXNet
    ``gluon.data.ArrayDataset`` (one item per row: a tuple of the columns'
    values), for a ``gluon.data.DataLoader``."""
    from mxnet.gluon.data import ArrayDataset  # here: the package must not load MXNet
    return ArrayDataset(*rank_arrays(*columns))
