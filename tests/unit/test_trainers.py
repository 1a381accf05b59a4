"""Libra inside the Hugging Face Trainer and Lightning (issue 16): one callback, the trainer's own step.

Each case trains the same model from the same seed twice, without and with ``LibraCallback``, and checks: the final
weights are ``torch.equal``; a plan that recomputes something was applied (the callback's INFO line says so); every
training step's peak, measured by the allocator meter from before the step's planning to the end of its backward,
is under the budget; nothing of Libra's is left on the model or the trainer afterwards. The budget is a share of
what the run without Libra measured, so it is below eager's peak and above the planner's minimum.
"""

from __future__ import annotations

import logging

import pytest
import torch

import libra
from libra.testing import AllocatorMeter, models

pytestmark = pytest.mark.usefixtures("one_thread")


def _clean(model: torch.nn.Module, allowed=()) -> list[str]:
    """What Libra could have left on ``model``: forwards replaced on instances, its marker attribute."""
    left = [f"{name or 'root'}.forward" for name, m in model.named_modules()
            if "forward" in vars(m) and name not in allowed]
    left += [k for m in model.modules() for k in vars(m) if "libra" in k]
    return left


def _share_of(starts: list[int], peaks: list[int], share: float) -> int:
    """A budget between the static bytes and eager's peak: ``share`` of the largest step's activation memory."""
    start, peak = max(starts), max(peaks)
    return start + int(share * (peak - start))


# ---- Hugging Face Trainer ----------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
from libra.integrations.transformers import LibraCallback as HFCallback  # noqa: E402

VOCAB, SEQ = 256, 64


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.1, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _data(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


class _StepMeter(transformers.TrainerCallback):
    """The allocator's peak from the start of each optimizer step (before Libra plans it) to the end of its last
    backward: every micro-batch of the accumulation, the fake profile and the planning included."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.peaks: list[int] = []
        self._meter = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._meter = AllocatorMeter()
        self._meter.__enter__()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._meter.__exit__(None, None, None)
        self.starts.append(self._meter.start_bytes)
        self.peaks.append(self._meter.peak_bytes)
        self._meter = None

    def on_train_end(self, args, state, control, **kwargs):
        if self._meter is not None:
            self._meter.__exit__(None, None, None)


def _hf_train(callback=None, *, steps=3, accumulate=1, bf16=False, evaluate=False, extra=()):
    model = _llama()
    meter = _StepMeter()
    args = transformers.TrainingArguments(
        output_dir="unused", use_cpu=True, per_device_train_batch_size=8, max_steps=steps, seed=7,
        gradient_accumulation_steps=accumulate, bf16=bf16, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        eval_strategy="steps" if evaluate else "no", eval_steps=1, per_device_eval_batch_size=8,
    )
    callbacks = ([callback] if callback is not None else []) + [meter, *extra]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(64),
                                   eval_dataset=_data(16, seed=2) if evaluate else None, callbacks=callbacks)
    trainer.train()
    return model, trainer, meter


@pytest.mark.parametrize("accumulate, bf16", [(1, False), (2, False), (1, True)], ids=["plain", "accumulate2", "bf16"])
def test_hf_trainer_under_a_budget(accumulate, bf16, caplog):
    expected, _, eager = _hf_train(accumulate=accumulate, bf16=bf16)
    budget = _share_of(eager.starts, eager.peaks, 0.5)
    callback = HFCallback(budget=budget)
    with caplog.at_level(logging.INFO, logger="libra"):
        model, trainer, meter = _hf_train(callback, accumulate=accumulate, bf16=bf16)

    for (name, want), got in zip(expected.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name
    planned = [r.getMessage() for r in caplog.records if "planned the training step" in r.getMessage()]
    assert planned and all(" recomputed" in m for m in planned)
    assert any(p.counts[libra.Decision.RECOMPUTE] > 0 for e in callback.plans.profiled.values() for p in e.plans.values())
    assert len(meter.peaks) == 3 and max(meter.peaks) <= budget, (meter.peaks, budget)
    assert max(eager.peaks) > budget  # the run without Libra would not fit
    # accelerate wraps the root's forward for autocast itself; Libra leaves nothing
    assert _clean(model, allowed=("",) if bf16 else ()) == []
    assert "training_step" not in vars(trainer) and "train" not in vars(trainer)


def test_hf_trainer_evaluation_runs_untouched():
    expected, reference, _ = _hf_train(steps=2, evaluate=True)
    budget = _share_of(*_eager_bounds(), 0.5)
    model, trainer, _ = _hf_train(HFCallback(budget=budget), steps=2, evaluate=True)
    losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert losses == [h["eval_loss"] for h in reference.state.log_history if "eval_loss" in h] and len(losses) == 2
    for want, got in zip(expected.state_dict().values(), model.state_dict().values()):
        assert torch.equal(got, want)


def _eager_bounds():
    _, _, eager = _hf_train(steps=2)
    return eager.starts, eager.peaks


class _Boom(transformers.TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        raise RuntimeError("boom")

    on_step_end = on_substep_end


def test_hf_trainer_that_raises_leaves_nothing_behind():
    starts, peaks = _eager_bounds()
    callback = HFCallback(budget=_share_of(starts, peaks, 0.5))
    model = _llama()
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, per_device_train_batch_size=8,
                                          max_steps=2, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(32), callbacks=[callback, _Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert callback.plans.steps_planned == 1  # the step ran under a plan before the error
    assert _clean(model) == []
    assert "training_step" not in vars(trainer) and "train" not in vars(trainer)


def test_hf_trainer_budget_too_small_raises_before_the_step():
    model = _llama()
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, per_device_train_batch_size=8,
                                          max_steps=2, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(32),
                                   callbacks=[HFCallback(budget="1MiB")])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(libra.BudgetInfeasibleError, match="lowest peak Libra can plan for it") as info:
        trainer.train()
    assert info.value.min_budget_bytes > 2**20
    assert all(p.grad is None for p in model.parameters())  # no step ran
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert _clean(model) == [] and "training_step" not in vars(trainer)


def test_hf_trainer_budget_for_the_first_step_only_says_the_budget_that_fits(caplog):
    """A budget that fits the first step but not the second (AdamW's state appears after the first optimizer step)
    raises before the second step, naming in bytes a budget that then trains every step; the planner's own advice
    (for the budget less the growth) is not repeated, so the message gives one figure."""

    def train(budget, steps=3):
        model = _llama()
        args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, per_device_train_batch_size=8,
                                              max_steps=steps, report_to=[], save_strategy="no", disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=_data(32),
                             callbacks=[HFCallback(budget=budget)]).train()

    def refused(budget) -> tuple[int, str]:
        """The error's figure and message (the error itself is dropped: its frames hold the model, which would be
        live memory on this device at the next run's start)."""
        try:
            train(budget)
        except libra.BudgetInfeasibleError as e:
            return e.min_budget_bytes, str(e)
        raise AssertionError(f"a budget of {budget} bytes trained every step")

    first, _ = refused(2**20)
    assert first > 2**20
    need, message = refused(first)  # the first step's minimum: step 1 runs, step 2 cannot
    assert "gradients and optimizer state added" in message
    assert need > first and f"budget={need}" in message
    assert "pass a budget of at least" not in message  # the inner, smaller figure
    with caplog.at_level(logging.INFO, logger="libra"):
        train(need)  # the figure the error named trains every step
    assert any("recomputed" in r.getMessage() for r in caplog.records)


def test_hf_gradient_checkpointing_is_said(caplog):
    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, per_device_train_batch_size=8,
                                          max_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(8),
                                   callbacks=[HFCallback(budget="1GiB")])
    with caplog.at_level(logging.WARNING, logger="libra"):
        trainer.train()
    assert any("gradient checkpointing is on" in r.getMessage() for r in caplog.records)


def test_hf_callback_refuses_a_bad_budget():
    with pytest.raises(libra.LibraError, match="budget"):
        HFCallback(budget=0.5)
    with pytest.raises(libra.LibraError, match="solver"):
        HFCallback(budget="1GiB", solver="fast")


# ---- Lightning ---------------------------------------------------------------------------------------------------
def test_gradients_the_loop_frees_before_the_backward_are_held_through_the_forward_only():
    """NOTE [Trainer steps]: Lightning sets the gradients of the step before to None between training_step and
    the backward, which makes new ones as the profiled step did; a plan for that step holds them through the forward
    only, where counted through the step they added a whole gradient set to a peak in the backward. Optimizer state
    is held through the step either way."""
    from libra.integrations._steps import StepPlans

    torch.manual_seed(0)
    model, x, y, loss_fn = models.make_gpt(batch=8, vocab=VOCAB, d=64, layers=4, heads=4, seq=SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plans = StepPlans(budget="10GiB")
    plans.plan_for(model, opt, (x,), {}, lambda: loss_fn(model(x), y).backward())
    first = plans.cached(model, opt, (x,), {}, grads_freed=True)
    loss_fn(model(x), y).backward()
    opt.step()  # gradients and AdamW's state now held
    through = plans.cached(model, opt, (x,), {}, grads_freed=False)
    forward = plans.cached(model, opt, (x,), {}, grads_freed=True)
    grads = sum(p.grad.nbytes for p in model.parameters())
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert through.predicted_peak_bytes == first.predicted_peak_bytes + grads + state  # the eager step's peak
    # the peak is in the backward: the freed gradients count only where the forward comes near it
    assert first.predicted_peak_bytes + state < forward.predicted_peak_bytes < through.predicted_peak_bytes


def _lightning():
    return pytest.importorskip("lightning")


def _lightning_module(lightning):
    class GPTModule(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net, _, _, self.loss_fn = models.make_gpt(batch=8, vocab=VOCAB, d=64, layers=4, heads=4, seq=SEQ)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.loss_fn(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return GPTModule()


def _lightning_meter(lightning):
    class StepMeter(lightning.pytorch.Callback):
        """The allocator's peak of each batch from before Libra plans it to the end of its backward."""

        def __init__(self) -> None:
            self.starts, self.peaks, self._meter = [], [], None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self._meter = AllocatorMeter()
            self._meter.__enter__()

        def _stop(self):
            if self._meter is not None:
                self._meter.__exit__(None, None, None)
                self.starts.append(self._meter.start_bytes)
                self.peaks.append(self._meter.peak_bytes)
                self._meter = None

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self._stop()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self._stop()

    return StepMeter()


def _lightning_train(lightning, callback=None, *, steps=3, accumulate=1, precision="32-true", extra=()):
    module = _lightning_module(lightning)
    meter = _lightning_meter(lightning)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    # Libra first: the meter's block starts before Libra plans the batch
    callbacks = ([callback] if callback is not None else []) + [meter, *extra]
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
                                precision=precision, callbacks=callbacks, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=loader)
    return module, meter


@pytest.mark.parametrize("accumulate, precision", [(1, "32-true"), (2, "bf16-mixed")], ids=["plain", "accumulate2-bf16"])
def test_lightning_trainer_under_a_budget(accumulate, precision, caplog):
    lightning = _lightning()
    from libra.integrations.lightning import LibraCallback

    expected, eager = _lightning_train(lightning, accumulate=accumulate, precision=precision)
    budget = _share_of(eager.starts, eager.peaks, 0.6)
    callback = LibraCallback(budget=budget)
    with caplog.at_level(logging.INFO, logger="libra"):
        module, meter = _lightning_train(lightning, callback, accumulate=accumulate, precision=precision)

    for (name, want), got in zip(expected.state_dict().items(), module.state_dict().values()):
        assert torch.equal(got, want), name
    assert any("planned the training step" in r.getMessage() for r in caplog.records)
    assert any(p.counts[libra.Decision.RECOMPUTE] > 0 for e in callback.plans.profiled.values() for p in e.plans.values())
    assert len(meter.peaks) == 3 * accumulate and max(meter.peaks) <= budget, (meter.peaks, budget)
    assert max(eager.peaks) > budget
    # from the second window on, the gradients the loop frees before the backward were planned as such
    assert any(until_backward > 0 for e in callback.plans.profiled.values() for _, until_backward in e.plans)
    assert _clean(module) == []


def test_lightning_trainer_that_raises_leaves_nothing_behind():
    lightning = _lightning()
    from libra.integrations.lightning import LibraCallback

    class Boom(lightning.pytorch.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom")

    _, eager = _lightning_train(lightning, steps=2)
    callback = LibraCallback(budget=_share_of(eager.starts, eager.peaks, 0.6))
    module = _lightning_module(lightning)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (32, SEQ)), torch.randint(0, VOCAB, (32, SEQ))), batch_size=8)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[callback, Boom()], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, train_dataloaders=loader)
    assert callback.plans.steps_planned >= 1
    assert _clean(module) == []


def test_lightning_manual_optimization_is_refused():
    lightning = _lightning()
    from libra.integrations.lightning import LibraCallback

    module = _lightning_module(lightning)
    module.automatic_optimization = False
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ))), batch_size=8)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[LibraCallback("1GiB")],
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    with pytest.raises(libra.LibraError, match="automatic optimization"):
        trainer.fit(module, train_dataloaders=loader)
    assert _clean(module) == []


class _ScaledMLP(torch.nn.Module):
    """A model whose loss depends on a value (``.item()``): it cannot run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                                torch.nn.Dropout(0.1), torch.nn.Linear(256, 64))
                                            for _ in range(4)])

    def forward(self, x, labels):
        scale = float(labels.abs().max().item())
        return {"loss": torch.nn.functional.mse_loss(self.blocks(x), labels) / scale}


def _scaled_train(callback=None):
    model = _ScaledMLP()
    g = torch.Generator().manual_seed(3)
    data = [{"x": torch.randn(64, generator=g), "labels": torch.randn(64, generator=g)} for _ in range(96)]
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, per_device_train_batch_size=32,
                                          max_steps=3, seed=7, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[callback] if callback is not None else [])
    trainer.train()
    return model


def test_hf_step_that_cannot_run_fake_is_profiled_for_real(caplog):
    expected = _scaled_train()
    callback = HFCallback(budget="1GiB")
    with caplog.at_level(logging.INFO, logger="libra"):
        model = _scaled_train(callback)
    assert any("cannot run on fake tensors" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    assert any("for real" in r.getMessage() for r in caplog.records)
    assert callback.plans.profiles_made == 1
    for want, got in zip(expected.state_dict().values(), model.state_dict().values()):
        assert torch.equal(got, want)
    assert _clean(model) == []
