"""How long a run is and how its learning rate moves: the run's total optimizer steps (from
train.max_steps or train.epochs, each epoch's own packing counting its micro-batches) and
transformers' warmup + cosine-with-floor schedule over them, rebuilt exactly on a resume."""
from __future__ import annotations

from contracts.finetune_config import FinetuneConfig
from entrypoint.data.sampler import PackedSampler


def schedule(optimizer, cfg: FinetuneConfig, total_steps: int | None = None, at_step: int = 0):
    """transformers' warmup + cosine down to a floor (min_lr_rate), over the run's total steps. Its
    warmup starts at lr 0 at step 0: the first optimizer step runs at lr 0. `at_step` rebuilds
    it mid-run (a resume that changed the schedule): the lr is the new schedule's at that step."""
    # transformers loads with the model, not when the worker starts: train.main sets its signal handlers first
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    t = cfg.train
    for group in optimizer.param_groups:   # a loaded optimizer carries the old peak lr
        group["lr"] = group["initial_lr"] = t.lr
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=t.warmup_steps,
                                                            num_training_steps=total_steps or t.max_steps,
                                                            min_lr_rate=t.min_lr_ratio)
    if at_step:
        scheduler.last_epoch = at_step
        for group, lr in zip(optimizer.param_groups, scheduler.get_lr()):
            group["lr"] = lr
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return scheduler


def steps_for_epochs(sampler: PackedSampler, epochs: int | None, world: int, grad_accum: int) -> int | None:
    """Optimizer steps that `epochs` passes over the data make (each epoch's own packing decides
    its micro-batch count); None without an epoch limit."""
    if epochs is None:
        return None
    bins = sum(len(sampler.epoch_bins(e)) for e in range(epochs))
    return bins // (world * grad_accum)
