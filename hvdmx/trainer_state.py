"""A Gluon trainer's state as MXNet 1.9.1 keeps it, read and written in one
place: the trainer's parameters, its optimizer, its updaters (one a
context) that hold the optimizer's states by parameter index, and its
kvstore; and the same for a Module (its optimizer, its one updater, its
kvstore). MXNet has no public API for these (Trainer.save_states and
load_states go through a file and one updater), so checkpoints
(checkpoint.py, checkpoint_residuals.py) and hvd.elastic's GluonState and
ModuleState (hvdmx/elastic/) go through this module, the only one that
touches the private fields of MXNet's Trainer, Module and Updater
(tests/test_layers.py checks). A class's own code (DistributedTrainer on
``self``) is not a reader from outside.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import mxnet as mx

__all__ = ["contexts", "drop_states", "init_kvstore", "kvstore", "kvstore_updating",
           "module_kvstore", "module_kvstore_updating", "module_training", "optimizer",
           "parameters", "put_state", "replace_optimizer", "states", "updaters"]


# ---- a Gluon trainer ------------------------------------------------------------

def parameters(trainer: mx.gluon.Trainer) -> List[Any]:
    """The trainer's Parameters, by index (the index of their states)."""
    return list(trainer._params)


def optimizer(trainer: mx.gluon.Trainer) -> Any:
    """The trainer's optimizer (an hvd.DistributedOptimizer's inner one, or
    what the user passed)."""
    return trainer._optimizer


def updaters(trainer: mx.gluon.Trainer) -> List[Any]:
    """The trainer's updaters, one a context, the first holding the states
    a checkpoint saves."""
    return list(trainer._updaters)


def contexts(trainer: mx.gluon.Trainer) -> List[mx.Context]:
    return list(trainer._contexts)


def kvstore_updating(trainer: mx.gluon.Trainer) -> Optional[str]:
    """The type of the kvstore the trainer updates its parameters on (which
    then holds the optimizer's states, out of the trainer's reach), else
    None."""
    if trainer._kvstore is not None and trainer._update_on_kvstore:
        return trainer._kvstore.type
    return None


def kvstore(trainer: mx.gluon.Trainer) -> Any:
    """The trainer's kvstore once made (its first step or init_kvstore), else
    None."""
    return trainer._kvstore if trainer._kv_initialized else None


def init_kvstore(trainer: mx.gluon.Trainer) -> None:
    """Makes the trainer's kvstore now, as its first step would (as
    Trainer.load_states does: the kvstore holds some of the state)."""
    if not trainer._kv_initialized:
        trainer._init_kvstore()


def replace_optimizer(trainer: mx.gluon.Trainer, new: Any, by_index: Dict[int, Any]) -> None:
    """The trainer trains with optimizer `new`, bound to its parameters, and
    every updater holds the states `by_index` (the first these arrays,
    the others copies; each moves to its weight's context at the next
    update), as Trainer.load_states leaves it."""
    new.param_dict = dict(enumerate(trainer._params))
    trainer._optimizer = new
    for n, updater in enumerate(trainer._updaters):
        mine = by_index if n == 0 else {i: _copy_state(s) for i, s in by_index.items()}
        updater.optimizer = new
        updater.aggregate_updates = new.aggregate_num > 0
        updater.states = dict(mine)
        updater.states_synced = dict.fromkeys(mine, False)


def _copy_state(state):
    if isinstance(state, mx.nd.NDArray):
        return state.copy()
    if isinstance(state, (tuple, list)):
        return type(state)(_copy_state(s) for s in state)
    return state


# ---- an updater (a Gluon trainer's, one a context, or a Module's) ----------------

def states(updater: Any) -> Dict[int, Any]:
    """The updater's optimizer states by parameter index (read them; change
    them with put_state and drop_states)."""
    return updater.states


def put_state(updater: Any, index: int, state: Any) -> None:
    """Parameter `index`'s state becomes `state`, moved to the weight's
    context at the next update."""
    updater.states[index] = state
    updater.states_synced[index] = False


def drop_states(updater: Any, keep: Iterable[int]) -> None:
    """Drops the states of every parameter index not in `keep` (the next
    update creates them anew)."""
    keep = set(keep)
    for index in [i for i in updater.states if i not in keep]:
        del updater.states[index]
        updater.states_synced.pop(index, None)


# ---- a Module -------------------------------------------------------------------

def module_kvstore_updating(module: mx.module.Module) -> Optional[str]:
    """As kvstore_updating, for a Module with its optimizer initialized."""
    return module._kvstore.type if module._update_on_kvstore else None


def module_training(module: mx.module.Module) -> Tuple[Any, List[Any], List[mx.Context]]:
    """(optimizer, [its one updater], contexts) of a Module with its
    optimizer initialized."""
    return module._optimizer, [module._updater], module._context


def module_kvstore(module: mx.module.Module) -> Any:
    return module._kvstore
