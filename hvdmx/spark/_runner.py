"""What hvdmx.spark takes from the launcher's modules (the function job, the
rank's bootstrap, the rendezvous server): every import from them is here, so
that a move of those modules changes this file only."""
from hvdmx.function_job import ADDRESSES_VARIABLE, RemoteTraceback, _connect, \
    _cloudpickle, _outcome_of_error, _prove_launcher, _raise_for, _receive_frame, \
    _send_frame, _Server  # noqa: F401
from hvdmx.function_job import _stop as _stop_launcher  # noqa: F401
from hvdmx.rendezvous_server import RendezvousServer  # noqa: F401
from hvdmx.rendezvous_wire import ADDRESS_VARIABLE, KEY_VARIABLES  # noqa: F401
from hvdmx.run_nompi import _BOOTSTRAP_LINE, Placement, rank_env  # noqa: F401
