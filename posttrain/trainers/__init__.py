"""Trainers: each a config dataclass plus a loop over shared pieces (no base class).

Shared pieces: `sections` (model / optim / train / log config sections), `optim` (AdamW groups, clipping,
the optimizer step), `schedule` (warmup + cosine / linear / constant), `accumulate` (gradient
accumulation with one normaliser), `loop` (seeding, batch stream, the step loop with progress and
metrics), `progress` (the bar, drawn against the step or time bound that ends the run), `checkpoint`
(step-N directories: commit marker, rotation), `train_state` (what a checkpoint holds and how it is
restored, bit-exactly), `resume` (`resume: auto | PATH`), `faults` (skipped non-finite updates, abort
after `max_bad_steps` in a row).

Beside the distill trainer, `distill_student` makes its student from the teacher by keeping some of its
decoder layers (`posttrain convert --num-layers / --keep-layers`).
"""
