"""Checkpoints a run continues from bit-exactly, one idea a module; no module here imports a trainer.

- `save`: step-N directories: the commit marker, atomic rename, fsync, rotation, and the plain
  `save_checkpoint` (an HF directory + trainer_state.json).
- `state`: what a checkpoint holds and how it is restored (`Checkpointer`): the model, optimizer,
  RNG and trainer state, FSDP2 shards through `posttrain.distributed.checkpoint`.
- `model`: what a checkpoint holds of the model (`save_trained`: adapter, quantized export or HF dir).
- `optim_state`, `rng_state`: the optimizer / scheduler and the generators as safetensors + JSON.
- `resume`: `resume: auto | PATH`: the run directory and the checkpoint a run starts from.
"""
