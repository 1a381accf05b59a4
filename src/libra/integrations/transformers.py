"""Libra in the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[LibraCallback(budget="20GiB")])``.

NOTE [The Trainer's step]: a ``TrainerCallback`` is handed the model, the optimizer and the dataloaders, but not
the trainer, and no event sees a batch before its forward runs. The callback finds its trainer on the call stack
of the event that reached it (``Trainer.__init__`` and ``Trainer.train`` call the callbacks), and wraps that
trainer's ``training_step`` (an attribute of the instance, removed at the end): each call, one micro-batch's
forward and backward with the Trainer's own autocast, loss scaling for gradient accumulation and
``accelerator.backward``, first gets its plan (NOTE [Trainer steps] in integrations/_steps.py) and then runs under
``libra.apply``, which is removed when the call returns or raises. Evaluation and prediction never call
``training_step``: they run untouched. When training raises, ``Trainer.train`` (wrapped when the callback was passed
to the constructor) removes the wrapper too.
"""

from __future__ import annotations

import logging
import sys

import transformers

from libra.errors import LibraError
from libra.integrations._steps import AppliedPlan, StepPlans
from libra.units import format_bytes

__all__ = ["LibraCallback"]

log = logging.getLogger("libra")


def _trainer_on_stack() -> transformers.Trainer | None:
    frame = sys._getframe(2)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


def _checkpointing(model) -> bool:
    """Whether HF gradient checkpointing is on (transformers 5 renamed ``is_gradient_checkpointing`` to
    ``is_activation_checkpointing`` and warns on the old name)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in getattr(model, "__dict__", {}):
            return bool(getattr(model, name))
    return False


class LibraCallback(transformers.TrainerCallback):
    """Runs every training step of a Hugging Face ``Trainer`` under a memory budget.

    Before the first step with each input signature, the Trainer's own training step is profiled on fake tensors
    (no eager memory, nothing trained), planned under ``budget``, and that step and the later ones like it run with
    the plan applied: gradients equal to training without Libra, bit for bit. Gradients and optimizer state that
    appear later (after the first optimizer step, and between accumulation micro-batches) are taken off the budget
    of the steps they are held in. Evaluation runs untouched; everything is removed when training ends or raises.

    Args:
        budget: the peak allowed during one training step (forward and backward of one micro-batch), parameters,
            gradients, optimizer state and everything else on the device included: bytes, or a string like
            ``"20GiB"``.
        fake: profile on fake tensors (default). A step that cannot run fake (an op whose output depends on values)
            is then profiled for real, eagerly, with a warning; ``False`` always profiles for real.
        solver: ``"greedy"`` (default) or ``"milp"``, as in :func:`libra.plan`.

    Raises:
        BudgetInfeasibleError: (from ``trainer.train()``) a step cannot fit the budget; raised before that step
            runs, with the lowest budget that would fit.

    Example:
        >>> trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
        ...                                callbacks=[LibraCallback(budget="20GiB")])
        >>> trainer.train()
    """

    def __init__(self, budget, *, fake: bool = True, solver: str = "greedy") -> None:
        self.plans = StepPlans(budget, fake=fake, solver=solver, what="LibraCallback")
        self.trainer: transformers.Trainer | None = None
        self._training = False
        self.applied = AppliedPlan()

    # ---- finding and wrapping the trainer (NOTE [The Trainer's step]) --------------------------------------------
    def _attach(self) -> None:
        trainer = _trainer_on_stack()
        if trainer is None:
            raise LibraError(
                "LibraCallback: expected to be called by a transformers.Trainer, but no Trainer is on the call "
                "stack. Fix: pass it as Trainer(..., callbacks=[LibraCallback(budget)]) or trainer.add_callback(...)."
            )
        if self.trainer is trainer:
            return
        if self.trainer is not None:
            raise LibraError(
                "LibraCallback: expected one Trainer per callback, but this one was given to a second "
                "Trainer. Fix: make a LibraCallback for each Trainer."
            )
        self.trainer = trainer

    def _wrap_train(self) -> None:
        """``trainer.train`` removes Libra's wrapper of ``training_step`` also when training raises."""
        trainer = self.trainer
        if getattr(vars(trainer).get("train"), "_libra", False):
            return
        original = trainer.train
        own = "train" in vars(trainer)

        def train(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                self._detach()
                if own:
                    trainer.train = original
                else:
                    vars(trainer).pop("train", None)

        train._libra = True
        trainer.train = train

    def _install_step(self) -> None:
        trainer = self.trainer
        if "training_step" in vars(trainer) and getattr(trainer.training_step, "_libra", False):
            return
        original = trainer.training_step

        def training_step(model, inputs, num_items_in_batch=None):
            if not self._training:
                return original(model, inputs, num_items_in_batch)
            try:
                plan = self.plans.cached(model, trainer.optimizer, (), inputs)
                if plan is None:
                    self.applied.leave()  # nothing of Libra's on the model while it is profiled
                    plan, result, ran = self.plans.plan_for(
                        model, trainer.optimizer, (), inputs, lambda: original(model, inputs, num_items_in_batch))
                    if ran:
                        return result
                self.applied.enter(model, plan)
                return original(model, inputs, num_items_in_batch)
            except BaseException:
                self.applied.leave()
                raise

        training_step._libra = True
        self._original_step = original
        self._step_was_own = "training_step" in vars(trainer)
        trainer.training_step = training_step

    def _detach(self) -> None:
        """Puts the trainer and the model back as they were (idempotent)."""
        self._training = False
        self.applied.leave()
        trainer = self.trainer
        if trainer is None:
            return
        if getattr(vars(trainer).get("training_step"), "_libra", False):
            if self._step_was_own:
                trainer.training_step = self._original_step
            else:
                del trainer.training_step

    # ---- events --------------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        self._attach()
        self._wrap_train()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._attach()
        self._install_step()
        self._training = True
        if _checkpointing(model) or args.gradient_checkpointing:
            log.warning(
                "libra: LibraCallback: Hugging Face gradient checkpointing is on. Its checkpointed layers keep only "
                "their inputs and are left as they are; Libra plans what remains, so it saves little more. For "
                "Libra's savings (it recomputes only where the budget needs it), train with "
                "gradient_checkpointing=False and keep the budget."
            )
        log.info("libra: LibraCallback: training steps will run under a budget of %s",
                 format_bytes(self.plans.budget_bytes))

    def on_train_end(self, args, state, control, **kwargs):
        self._detach()
