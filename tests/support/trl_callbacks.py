"""A TRL trainer callback that records the learning rates around each optimizer step (the TRL integration's tests)."""

from transformers import TrainerCallback


class Recorder(TrainerCallback):
    """The lr inside each optimizer step (after VCPO's scaling), the scheduler's lr for it and the lr right after
    the step (VCPO's callback, registered first, has restored it)."""

    def __init__(self):
        self.scaled, self.base, self.after = [], [], []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        self.scaled.append(optimizer.param_groups[0]["lr"])
        self.base.append(lr_scheduler.get_last_lr()[0])

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.after.append(optimizer.param_groups[0]["lr"])
