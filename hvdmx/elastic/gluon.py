"""hvd.elastic.GluonState: the state of Gluon training (a Block's
parameters and its trainer's optimizer)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import mxnet as mx
from mxnet.gluon.parameter import Parameter, ParameterDict

from hvdmx import process_sets as _process_sets
from hvdmx.checkpoint_residuals import residual_holders
from hvdmx.optimizer import broadcast_parameters
from hvdmx.trainer import DistributedTrainer
from hvdmx.elastic.state import _NAME, _check_attribute_names, _TrainingState


def _check_params(params) -> List[Tuple[str, Parameter]]:
    """(key, Parameter) sorted by key: a Block's structural keys (as
    save_parameters), or the dict's."""
    fn = "hvdmx.elastic.GluonState"
    if isinstance(params, mx.gluon.Block):
        named = params._collect_params_with_prefix()
    elif isinstance(params, (ParameterDict, dict)):
        named = dict(params.items())
    else:
        raise TypeError(f"{fn}: argument 'params' must be a gluon Block (the model), a "
                        "ParameterDict or a dict of Parameters, got "
                        f"{type(params).__name__} ({params!r:.80}); pass net.collect_params()")
    if not named:
        raise ValueError(f"{fn}: argument 'params' holds no parameters ({params!r:.80}); pass "
                         "the model's, net.collect_params()")
    for key, value in named.items():
        if not isinstance(key, str):
            raise TypeError(f"{fn}: the keys of argument 'params' must be str, got {key!r}")
        if not isinstance(value, Parameter):
            raise TypeError(f"{fn}: params[{key!r}] must be a gluon Parameter, got "
                            f"{type(value).__name__} ({value!r:.80}); pass "
                            "net.collect_params()")
    return sorted(named.items())


def _check_trainer(trainer, params: List[Tuple[str, Parameter]]):
    fn = "hvdmx.elastic.GluonState"
    if trainer is None:
        return None
    if not isinstance(trainer, mx.gluon.Trainer):
        raise TypeError(f"{fn}: argument 'trainer' must be a gluon.Trainer (hvd."
                        "DistributedTrainer) or None, got "
                        f"{type(trainer).__name__} ({trainer!r:.80})")
    mine = {id(p) for _, p in params}
    for p in trainer._params:
        if id(p) not in mine:
            raise ValueError(f"{fn}: the trainer's parameter '{p.name}' is not among argument "
                             "'params'; pass the parameters the trainer trains "
                             "(net.collect_params())")
    if isinstance(trainer, DistributedTrainer) and \
            trainer._process_set is not _process_sets.global_process_set:
        raise ValueError(f"{fn}: argument 'trainer' averages over {trainer._process_set!r}, "
                         "which a reset does not keep (a reset forms a new job of new ranks); "
                         "use a DistributedTrainer over the whole job (the default "
                         "process_set)")
    return trainer


def _check_states_in_trainer(trainer) -> None:
    if trainer._kvstore is not None and trainer._update_on_kvstore:
        raise ValueError("hvdmx.elastic.GluonState: the trainer updates its parameters on its "
                         f"kvstore ({trainer._kvstore.type}), which holds the optimizer "
                         "states out of the state's reach; use hvd.DistributedTrainer")




class GluonState(_TrainingState):
    """The state of Gluon training: the parameters ``params`` (a Block, or
    ``net.collect_params()``), the optimizer of ``trainer`` (its states:
    momentum, Adam's moments, ...; its update counts, learning rate and
    schedule), and keyword values such as ``epoch`` and ``batch`` (as
    ObjectState's). With a DistributedTrainer it also keeps the trainer's
    Compression.onebit residuals (this rank's own) and, under
    ``easgd_beta``, the EASGD center and the count of local steps.

    ``save()`` copies the parameters, optimizer states, residuals and center
    into CPU buffers that it keeps (allocated at the first save, reused
    after); ``restore()`` copies them back; ``sync()`` broadcasts rank 0's
    parameters, optimizer states, center and values to every rank and saves
    them; each rank keeps its own residuals (a worker that joins starts
    with none, that is zeros). A parameter whose shape is still deferred at
    a save is left as it is by the restore; commit after the first forward
    pass. After a reset, a DistributedTrainer's gradient averaging follows
    the new number of ranks.
    """

    def __init__(self, params, trainer: Optional[mx.gluon.Trainer] = None,
                 **kwargs: Any) -> None:
        _check_attribute_names(type(self), kwargs)
        self._params = _check_params(params)
        self._trainer = _check_trainer(trainer, self._params)
        super().__init__(**kwargs)

    @property
    def params(self) -> Dict[str, Parameter]:
        """The parameters, by key."""
        return dict(self._params)

    @property
    def trainer(self) -> Optional[mx.gluon.Trainer]:
        return self._trainer

    def _param_copies(self) -> List[Optional[List[mx.nd.NDArray]]]:
        return [p._data for _, p in self._params]

    def _optimizer_and_updaters(self) -> Tuple[Any, List[Any], List[mx.Context]]:
        trainer = self._trainer
        if trainer is None:
            return None, [], []
        _check_states_in_trainer(trainer)
        return trainer._optimizer, trainer._updaters, trainer._contexts

    def _residual_holders(self) -> Dict[str, dict]:
        return residual_holders(self._trainer) if self._trainer is not None else {}

    def _sync_params(self) -> None:
        broadcast_parameters({i: param for i, (_, param) in enumerate(self._params)},
                             root_rank=0, prefix=_NAME + "param.")

    def _easgd(self) -> Optional[DistributedTrainer]:
        trainer = self._trainer
        return trainer if isinstance(trainer, DistributedTrainer) and \
            trainer._local_sgd_steps > 1 else None

    def reset(self) -> None:
        if isinstance(self._trainer, DistributedTrainer):
            self._trainer._elastic_reset()
