"""Trainers: each a config dataclass plus a loop over shared pieces (no base class).

Shared pieces: `sections` (model / optim / train / log config sections), `optim` (AdamW groups, clipping,
the optimizer step), `schedule` (warmup + cosine / linear / constant), `accumulate` (gradient
accumulation with one normaliser), `loop` (seeding, batch stream, the step loop with progress and
metrics), `progress` (the bar, drawn against the step or time bound that ends the run), `faults`
(skipped non-finite updates, abort after `max_bad_steps` in a row), `adapters` (what a trainer trains:
full weights, LoRA, QLoRA, QAT), `lifecycle` (what every trainer does around its step: the pad id, the data
report, the checkpointer and the resume, the steps with held-out evaluations before and after). Checkpoints (save, restore bit-exactly, resume) are `posttrain.checkpoint`.

By role: `preference/` holds the DPO family and KTO; the RL trainers are the `rl*` and `ppo` modules.

Beside the distill trainer, `distill_student` makes its student from the teacher by keeping some of its
decoder layers (`posttrain convert --num-layers / --keep-layers`).
"""
