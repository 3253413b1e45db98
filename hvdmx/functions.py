"""``horovod.mxnet.functions`` under hvdmx: the object collectives
(hvdmx/objects.py), and the names Horovod's module imports and so also
exposes to a script (``from horovod.mxnet.functions import rank`` works
there), so that every import a horovod.mxnet script makes works here."""
from hvdmx.basics import rank, size
from hvdmx.gather_scatter import allgather
from hvdmx.objects import allgather_object, broadcast_object
from hvdmx.ops import broadcast_

__all__ = ["allgather", "allgather_object", "broadcast_", "broadcast_object", "rank", "size"]
