"""Libra in Lightning 2.x: ``lightning.Trainer(..., callbacks=[LibraCallback(budget="20GiB")])``.

NOTE [Lightning's step]: ``on_train_batch_start`` sees the batch on its device before the step runs. For a batch
with a new input signature the callback profiles, on fake tensors, what the loop is about to do: the
LightningModule's ``training_step`` under the precision plugin's ``train_step_context`` (autocast), the loss divided
by ``accumulate_grad_batches``, and ``LightningModule.backward`` (NOTE [Trainer steps] in integrations/_steps.py).
While it runs fake, ``self.log`` and ``self.log_dict`` do nothing (a fake value must not reach the logger). The
plan is applied from then on (the ``libra.apply`` block stays open while the plan stays the same, and each batch
starts a step: :func:`libra.runtime.apply.begin_step`, as ``training_step`` need not call the module itself);
it is removed at the end of fitting or when it raises (``on_exception``). Validation runs without gradients, so
untouched. At the first micro-batch of each accumulation window the loop sets the gradients of the step before to
None after ``training_step``, before the backward: they count as held through the forward only (at the other
micro-batches they are accumulated into, held through the step).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import lightning
import torch

from libra.errors import LibraError
from libra.integrations._steps import AppliedPlan, StepPlans
from libra.runtime.apply import begin_step
from libra.units import format_bytes

__all__ = ["LibraCallback"]

log = logging.getLogger("libra")


def _no_log(*args, **kwargs) -> None:
    return None


class LibraCallback(lightning.pytorch.Callback):
    """Runs every training step of a Lightning ``Trainer`` under a memory budget.

    Before the first batch with each input signature, the LightningModule's training step (forward, loss and
    backward under the Trainer's precision) is profiled on fake tensors (no eager memory, nothing trained), planned
    under ``budget``, and run with the plan applied: gradients equal to training without Libra, bit for bit.
    Optimizer state and accumulated gradients that appear later are taken off the budget of the steps that hold
    them. Validation runs untouched; everything is removed when fitting ends or raises.

    Args:
        budget: the peak allowed during one training step (forward and backward of one batch), parameters,
            gradients, optimizer state and everything else on the device included: bytes, or a string like
            ``"20GiB"``.
        solver: ``"greedy"`` (default) or ``"milp"``, as in :func:`libra.plan`.

    Raises:
        BudgetInfeasibleError: (from ``trainer.fit``) a step cannot fit the budget; raised before it runs.
        LibraError: the module uses manual optimization (not supported yet), or its training step cannot run on
            fake tensors (an op whose output depends on values, named in the message).

    Example:
        >>> trainer = lightning.Trainer(max_steps=100, callbacks=[LibraCallback(budget="20GiB")])
        >>> trainer.fit(module, train_dataloaders=loader)
    """

    def __init__(self, budget, *, solver: str = "greedy") -> None:
        # a Lightning step runs inside the loop: one profiled for real would run twice, so fake only
        self.plans = StepPlans(budget, solver=solver, what="LibraCallback", real_fallback=False)
        self.applied = AppliedPlan()

    def _step(self, trainer, module, batch, batch_idx):
        """What the loop runs for this batch (NOTE [Lightning's step]), for a fake profile."""

        def step():
            module.log, module.log_dict = _no_log, _no_log
            try:
                with trainer.precision_plugin.train_step_context():
                    out = module.training_step(batch, batch_idx)
            finally:
                del module.log, module.log_dict
            loss = out["loss"] if isinstance(out, Mapping) else out
            if trainer.accumulate_grad_batches > 1:
                loss = loss / trainer.accumulate_grad_batches
            module.backward(loss)
            return out

        return step

    def on_train_start(self, trainer, pl_module) -> None:
        if not pl_module.automatic_optimization:
            raise LibraError(
                "LibraCallback: expected a LightningModule with automatic optimization, but "
                f"{type(pl_module).__name__}.automatic_optimization is False: its training_step steps the optimizer "
                "itself, which Libra cannot profile without running it. Fix: use automatic optimization, or call "
                "libra.profile / libra.plan / libra.apply around your own step."
            )
        log.info("libra: LibraCallback: training steps will run under a budget of %s",
                 format_bytes(self.plans.budget_bytes))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        # the loop sets the gradients to None after training_step at the first micro-batch of each window, unless
        # the module or the optimizer zero them its own way (kept allocated, perhaps): then held through the step
        freed = (batch_idx % trainer.accumulate_grad_batches == 0 and optimizer is not None
                 and type(pl_module).optimizer_zero_grad is lightning.LightningModule.optimizer_zero_grad
                 and type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad)
        plan = self.plans.cached(pl_module, optimizer, (batch,), {}, freed)
        if plan is None:
            self.applied.leave()  # nothing of Libra's on the module while it is profiled
            plan, _, _ = self.plans.plan_for(pl_module, optimizer, (batch,), {},
                                             self._step(trainer, pl_module, batch, batch_idx), freed)
        self.applied.enter(pl_module, plan)
        begin_step(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.applied.leave()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.applied.leave()

    def teardown(self, trainer, pl_module, stage) -> None:
        self.applied.leave()
