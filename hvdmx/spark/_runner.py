"""What hvdmx.spark takes from the launcher's modules (the function job, the
rank's bootstrap, the rendezvous server): every import from them is here, so
that a move of those modules changes this file only."""
from hvdmx.runner.function_job import ADDRESSES_VARIABLE, PROTOCOL, RemoteTraceback, \
    FunctionServer, cloudpickle_module, connect_to_launcher, outcome_of_error, raise_for, \
    start_timeout_seconds, stop_launcher  # noqa: F401
from hvdmx.rendezvous.server import RendezvousServer  # noqa: F401
from hvdmx.rendezvous.wire import ADDRESS_VARIABLE, KEY_VARIABLES, accept_channel  # noqa: F401
from hvdmx.runner.bootstrap import variables_line  # noqa: F401
from hvdmx.runner.nompi import BOOTSTRAP, Placement, rank_env  # noqa: F401
