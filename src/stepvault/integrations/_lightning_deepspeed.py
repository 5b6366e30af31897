"""Lightning's ``DeepSpeedStrategy`` through ``StepvaultCheckpoint``: the strategy's
``save_checkpoint``/``load_checkpoint`` of ``stepvault:`` paths go through DeepSpeed's own
engine with a :class:`~stepvault.integrations.deepspeed.DeepSpeedCheckpointer` installed on
it (the one DeepSpeed checkpoint engine; no second one).

Lightning's DeepSpeed strategy writes its checkpoints with ``engine.save_checkpoint(dir,
client_state=<Lightning's dict without the weights and optimizer>)`` and reads them back
with ``engine.load_checkpoint``, which returns that dict. This part does the same with the
engine's checkpoints routed into the store: every rank writes its ZeRO partitions into one
collective checkpoint (the callback's collective manager: policies, retention, lease,
async staging), and a resume lets every rank read and verify its files, the ranks agreeing
(damage anywhere: every rank falls back together) before DeepSpeed's own load places
them. Lightning's dict (loops, callbacks with every rank's RNG, schedulers,
hyperparameters) rides in the engine's ``client_state`` under one key, in the safe encoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from ..errors import StepvaultError, UnsupportedTypeError

if TYPE_CHECKING:
    from ._lightning_impl import CheckpointMixin
    from .deepspeed import DeepSpeedCheckpointer

#: Key of Lightning's checkpoint dict in the engine's ``client_state``.
CLIENT_KEY = "stepvault_lightning"


def is_deepspeed_strategy(pl: Any, strategy: Any) -> bool:
    """Whether ``strategy`` is (a subclass of) Lightning's ``DeepSpeedStrategy``."""
    kind = getattr(pl.strategies, "DeepSpeedStrategy", None)
    return kind is not None and isinstance(strategy, kind)


class LightningDeepSpeed:
    """The callback's DeepSpeed part: a :class:`DeepSpeedCheckpointer` on the strategy's
    engine (made once the engine exists, on the callback's collective manager), and the
    ``save_checkpoint``/``load_checkpoint`` the callback installs on the strategy."""

    def __init__(self, callback: CheckpointMixin, strategy: Any) -> None:
        self.callback = callback
        self.strategy = strategy
        self.checkpointer: DeepSpeedCheckpointer | None = None

    def attach(self) -> DeepSpeedCheckpointer:
        """The checkpointer on the strategy's engine (installed at the first call: the
        engine exists once the strategy is set up, before a resume or the first step)."""
        if self.checkpointer is not None:
            return self.checkpointer
        mgr = self.callback.manager
        engine = getattr(self.strategy, "model", None)
        if mgr is None or engine is None or not hasattr(engine, "checkpoint_engine"):
            raise StepvaultError(
                f"{type(self.strategy).__name__}: saving to or loading a stepvault: path "
                "needs trainer.fit() with StepvaultCheckpoint (the DeepSpeed engine and the "
                "collective manager exist only while fitting); for evaluation, read the "
                "weights with stepvault.integrations.deepspeed.load_fp32_state_dict"
            )
        from .deepspeed import DeepSpeedCheckpointer

        # Lightning's dict carries every rank's RNG (the callback's state): the engine's
        # own RNG copy would be restored at the wrong moment (before the loops rebuild
        # their iterators), so the checkpointer keeps none.
        self.checkpointer = DeepSpeedCheckpointer.with_manager(engine, mgr, rng=False)
        return self.checkpointer

    def save(self, checkpoint: dict[str, Any], step: int, strategy: Any) -> None:
        """Every rank: Lightning's dict of ``step`` saved through the DeepSpeed engine,
        as DeepSpeedStrategy.save_checkpoint does (weights and optimizer from the engine)."""
        callback = self.callback
        due = callback._due if callback._due is not None and callback._due[0] == step else None
        rest = callback._rest(checkpoint, ("state_dict", "optimizer_states"))
        try:
            self.attach().save(
                step,
                client_state={CLIENT_KEY: rest},
                epoch=due[1] if due else checkpoint.get("epoch"),
                metrics=due[2] if due else {},
                metadata={**callback._metadata(), "lightning_strategy": type(strategy).__name__},
                force=True,  # the callback asked the policy (a due save) or the user did
            )
        except UnsupportedTypeError as exc:
            raise UnsupportedTypeError(
                f"{exc}\n(Lightning's checkpoint dict, stored in DeepSpeed's client_state: "
                "callbacks' state_dict(), on_save_checkpoint() additions and "
                "save_hyperparameters())"
            ) from None

    def load(self, step: int | Literal["latest", "best"], strategy: Any) -> dict[str, Any]:
        """Every rank: ``step`` loaded into the engine by DeepSpeed (the ranks agree on a
        checkpoint that verifies everywhere); Lightning's dict, as the strategy's own
        ``load_checkpoint`` returns it."""
        if step == "best":
            raise ValueError(
                "ckpt_path='stepvault:best' is not available under DeepSpeedStrategy: give "
                "stepvault:latest or stepvault:<step>"
            )
        module = strategy.lightning_module
        fn = module.trainer.state.fn if module is not None else None
        fitting = str(getattr(fn, "value", fn)) == "fit"  # TrainerFn.FITTING of either package
        ckpt = self.attach()
        info = ckpt.resume(
            step,
            load_optimizer_states=fitting,
            # Lightning restores its schedulers from its own dict (as its own load does)
            load_lr_scheduler_states=False,
            load_module_strict=getattr(module, "strict_loading", True),
        )
        info = self.callback._accept(info)
        checkpoint = ckpt.client_state.get(CLIENT_KEY)
        if not isinstance(checkpoint, dict):
            raise StepvaultError(
                f"{self.callback.run}@{info.step} holds no Lightning state (saved by "
                "DeepSpeedCheckpointer outside Lightning?); it cannot resume a Trainer"
            )
        return dict(checkpoint)

    def release(self) -> None:
        """Give DeepSpeed back its checkpoint engine (the manager is the callback's to close)."""
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            ckpt.close()
