"""Accelerate with a DeepSpeed plugin: what :class:`~stepvault.integrations.accelerate.
AcceleratorCheckpointer` keeps beside the prepared engine's own checkpoint.

The engine (model, ZeRO-partitioned optimizer, its own scheduler) is saved and loaded by
DeepSpeed through :class:`~stepvault.integrations.deepspeed.DeepSpeedCheckpointer`; the
accelerator's other state (its schedulers, stateful loaders, registered objects,
``accelerator.step`` and the user's ``extra``) travels as plain values in the engine's
``client_state``, as ``Accelerator.save_state`` keeps them beside DeepSpeed's folder.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from ..errors import StepvaultError
from .accelerate import STEP_KEY, _name

#: Key of the accelerator's own values in a DeepSpeed checkpoint's ``client_state``.
CLIENT_KEY = "stepvault_accelerate"


def deepspeed_engine(accelerator: Any) -> Any:
    """The one DeepSpeed engine ``accelerator.prepare`` made (its first prepared model)."""
    from deepspeed import DeepSpeedEngine

    engines = [m for m in accelerator._models if isinstance(m, DeepSpeedEngine)]
    if len(engines) != 1:
        raise StepvaultError(
            f"AcceleratorCheckpointer under DeepSpeed needs exactly one prepared model (a "
            f"DeepSpeed engine), found {len(engines)}: create the checkpointer after "
            "accelerator.prepare(model, optimizer, ...); several DeepSpeed models in one "
            "Accelerator are not supported (give each its own DeepSpeedCheckpointer)"
        )
    return engines[0]


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def client_state(accelerator: Any, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """What ``save_state`` keeps beside a DeepSpeed engine's model and optimizer, as
    plain values for the engine's ``client_state`` (the engine saves its own scheduler)."""
    out: dict[str, Any] = {STEP_KEY: int(accelerator.step)}
    for i, sched in enumerate(accelerator._schedulers):
        out[_name("scheduler", i)] = sched.state_dict()
    stateful = [dl for dl in accelerator._dataloaders if getattr(dl, "use_stateful_dataloader", 0)]
    for i, loader in enumerate(stateful):
        out[_name("dataloader", i)] = loader.state_dict()
    for i, obj in enumerate(accelerator._custom_objects):
        out[f"custom_{i}"] = obj.state_dict()
    out["extra"] = {k: v.state_dict() if _stateful(v) else v for k, v in (extra or {}).items()}
    return {CLIENT_KEY: out}


def apply_client_state(
    accelerator: Any,
    client: Mapping[str, Any],
    extra: MutableMapping[str, Any] | None,
    where: str,
) -> None:
    """Put the values of :func:`client_state` back into the accelerator's objects."""
    values = client.get(CLIENT_KEY)
    if not isinstance(values, Mapping):
        raise StepvaultError(
            f"{where} holds no Accelerate state (not saved by AcceleratorCheckpointer): "
            "resume it with DeepSpeedCheckpointer, or start without restore()"
        )
    stateful = [dl for dl in accelerator._dataloaders if getattr(dl, "use_stateful_dataloader", 0)]
    stored_extra = values.get("extra") or {}
    wanted = [_name("scheduler", i) for i in range(len(accelerator._schedulers))]
    wanted += [_name("dataloader", i) for i in range(len(stateful))]
    wanted += [f"custom_{i}" for i in range(len(accelerator._custom_objects))]
    absent = [k for k in wanted if k not in values]
    absent += [f"extra[{k!r}]" for k in (extra or {}) if k not in stored_extra]
    if absent:
        raise StepvaultError(
            f"{where} does not hold {', '.join(absent)} of this accelerator: it was saved "
            "with other schedulers, loaders, registered objects or extra keys"
        )
    for i, sched in enumerate(accelerator._schedulers):
        sched.load_state_dict(values[_name("scheduler", i)])
    for i, loader in enumerate(stateful):
        loader.load_state_dict(values[_name("dataloader", i)])
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(values[f"custom_{i}"])
    accelerator.step = int(values[STEP_KEY])
    if extra is not None:
        for key in extra:
            if _stateful(extra[key]):
                extra[key].load_state_dict(stored_extra[key])
            else:
                extra[key] = stored_extra[key]
