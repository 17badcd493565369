"""The DPO family and KTO on preference data.

- `dpo`: the trainer (`DPOConfig`, `train_dpo`): sigmoid, cdpo, robust, hinge, ipo, simpo, orpo and kto
  on pairs; KTO on an unpaired file runs `kto.KTORun` inside it.
- `kto`: KTO on unpaired (prompt, completion, label) rows, fixed batches as TRL's KTOTrainer.
- `logps`: sequence log-probabilities (summed completion-token logps) of tokenized rows.
- `reference`: the reference model's log-probs, precomputed or live (with LoRA: the base, adapters off).
- `unpaired`: reading and batching KTO's unpaired rows. Pairs are read by `posttrain.data.preference_pairs`.
"""
