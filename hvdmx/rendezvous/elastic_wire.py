"""What hvdmxrun's elastic service and an elastic worker both know (Note
[The elastic rendezvous] in hvdmx/runner/elastic/service.py): the variables
the launcher sets for a worker, the service's scope, and the answer to a
join. Here, in the rendezvous's room, so that the worker's side
(hvdmx/elastic/) needs nothing of the launcher's (hvdmx/runner/).
"""
from __future__ import annotations

from typing import List, Tuple

from hvdmx.rendezvous.wire import Reader

# What a worker's environment says of it: which slot it is (host:index).
SLOT_VARIABLE = "HVDMX_ELASTIC_SLOT"
# What the workers' hvd.elastic.run reads: the resets it may do (hvdmxrun
# --reset-limit; hvdmx/elastic/recovery.py).
RESET_LIMIT_VARIABLE = "HVDMX_ELASTIC_RESET_LIMIT"
# The scope the service names in its welcome.
SCOPE = "elastic"


def generation_answer(r: Reader) -> Tuple[int, int, int, int]:
    """(generation, rank, size, port) of a join's answer."""
    out = r.unpack("IIIH")
    r.end()
    return out


__all__: List[str] = ["RESET_LIMIT_VARIABLE", "SCOPE", "SLOT_VARIABLE", "generation_answer"]
