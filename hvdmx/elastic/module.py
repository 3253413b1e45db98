"""hvd.elastic.ModuleState: the state of Module training (the Module
API's GluonState)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import mxnet as mx

from hvdmx.checkpoint_residuals import residual_holders
from hvdmx.ops import broadcast_
from hvdmx.elastic.state import _NAME, _check_attribute_names, _TrainingState


def _check_module(module) -> mx.module.Module:
    fn = "hvdmx.elastic.ModuleState"
    if not isinstance(module, mx.module.Module):
        raise TypeError(f"{fn}: argument 'module' must be an mx.mod.Module, got "
                        f"{type(module).__name__} ({module!r:.80}); for Gluon use "
                        "hvd.elastic.GluonState")
    if not (module.binded and module.params_initialized):
        raise ValueError(f"{fn}: argument 'module' is not ready (binded={module.binded}, "
                         f"params_initialized={module.params_initialized}); call "
                         "module.bind(...) and module.init_params(...) first")
    return module


class ModuleState(_TrainingState):
    """The state of Module training (the Module API's GluonState): the
    module's parameters (arg and aux params, on each of its contexts), its
    optimizer (``hvd.DistributedOptimizer``, its states on the module's
    updater, its update counts, learning rate and schedule; Compression.onebit's
    residuals, this rank's own) once ``module.init_optimizer`` has run, and
    keyword values such as ``epoch`` and ``batch`` (as ObjectState's).
    ``save``, ``restore`` and ``sync`` work as GluonState's; the module must
    be bound with its parameters initialized, and must keep its optimizer
    states itself (``init_optimizer(kvstore=None, ...)``, or a kvstore that
    does not update on the kvstore).
    """

    def __init__(self, module: mx.module.Module, **kwargs: Any) -> None:
        _check_attribute_names(type(self), kwargs)
        self._module = _check_module(module)
        super().__init__(**kwargs)

    @property
    def module(self) -> mx.module.Module:
        return self._module

    def _arrays_by_param(self) -> List[List[mx.nd.NDArray]]:
        """Each arg param's arrays, then each aux param's, one per context."""
        group = self._module._exec_group
        return [list(arrays) for arrays in group.param_arrays + group.aux_arrays]

    def _param_copies(self) -> List[Optional[List[mx.nd.NDArray]]]:
        return list(self._arrays_by_param())

    def _optimizer_and_updaters(self) -> Tuple[Any, List[Any], List[mx.Context]]:
        module = self._module
        if not module.optimizer_initialized:
            return None, [], []
        if module._update_on_kvstore:
            raise ValueError("hvdmx.elastic.ModuleState: the module updates its parameters "
                             f"on its kvstore ({module._kvstore.type}), which holds the "
                             "optimizer states out of the state's reach; call "
                             "module.init_optimizer(kvstore=None, optimizer="
                             "hvd.DistributedOptimizer(...))")
        return module._optimizer, [module._updater], module._context

    def _residual_holders(self) -> Dict[str, dict]:
        module = self._module
        if not module.optimizer_initialized:
            return {}
        return residual_holders(optimizer=module._optimizer, kvstore=module._kvstore)

    def save(self) -> None:
        if self._module._exec_group.aux_arrays:
            # BatchNorm's moving mean and variance (MXNet 1.9.1, CPU), read
            # right after a step, were seen to hold the value before it
            # (tests/parallel/test_elastic.py, ModuleState's tests): the copy
            # does not wait for their update, so wait for every operation.
            mx.nd.waitall()
        super().save()

    def _sync_params(self) -> None:
        for i, arrays in enumerate(self._arrays_by_param()):
            first = broadcast_(arrays[0], 0, name=f"{_NAME}module.{i}")
            for other in arrays[1:]:
                first.copyto(other)
        self._params_changed()

    def _params_changed(self) -> None:
        self._module._params_dirty = True  # get_params() reads the arrays again
