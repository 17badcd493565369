"""The rollout layer: prompts in, scored groups of completions out. Above `engine` and `rewards`, below
`trainers` and `eval`; it imports no trainer (the RL config's sections reach it as plain values or
through the small protocols of `prompts` and `scoring`).

- `batch`: `RolloutBatch` (G samples per group, numbered group by group) and `PROMPT_KEY`, the key a row
  carries its prompt under.
- `prompts`: prompt sources: a built-in task (`posttrain.tasks`) or a dataset file with a prompt column,
  read through `posttrain.data.readers` (JSON Lines / JSON, Parquet, a saved HF dataset).
- `generate`: one engine call over the live policy module, n samples per prompt, with their logprobs.
- `scoring`: the reward functions a run scores with, rewards per sample, DAPO's soft overlong penalty,
  and the groups dynamic sampling drops.
- `collect`: the step's batch, with DAPO dynamic sampling's refill rounds (data-parallel aware).
- `evaluate`: greedy (temperature 0) accuracy on held-out prompts through the same engine.
"""
