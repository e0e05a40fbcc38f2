"""Training on the CPU (or any backend): `data` (corpus, split by file, batches), `bpe` (tokenizer
training), `schedule` (warmup + cosine, AdamW with clipping), `step` (jitted steps, router-bias update),
`loop` (the run: checkpoints, validation, export, log and plot). `jaxhybrid train` is the command."""

from jaxhybrid.train.loop import TrainConfig, TrainError, train

__all__ = ["TrainConfig", "TrainError", "train"]
