"""A Hugging Face `Trainer` that keeps training under elastic changes.

Run it under elasticrun (or torchrun) on any number of nodes, every node with the same
command and the same shared output folder:

    python -m elasticrun --nnodes=1:4 --nproc-per-node=gpu --rdzv-backend=c10d \
        --rdzv-endpoint=host0:29400 --rdzv-id=hf examples/huggingface/train.py \
        --max-steps 300 --output-dir /shared/hf-out

What makes it elastic (see README.md next to it):
- the Trainer (through accelerate) reads the launcher's environment on every start, so
  a restart at another world size simply runs at that size;
- it saves a checkpoint folder every `--save-steps` steps (`save_steps`), and every
  (re)start resumes from the newest complete one (`resume_from_checkpoint`): model,
  optimizer, scheduler and step, with the data skipped ahead to where it stopped;
- a folder is complete once its trainer_state.json is there (the Trainer writes that
  file last): a node killed while saving leaves a newer folder without it, and the
  restart resumes from the one before.

Rank 0 prints one line per step, and where it (re)starts:

    start at step 20: world size 1, restart count 0
    Step #21  Loss: 2.53093  (world size 1)

The model is a tiny GPT-2 built from a config object and the data is generated (token
sequences that count upwards), so nothing is downloaded. CPU (gloo) when there is no
GPU, one GPU per process (nccl) when there are.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

import elasticrun.worker.callbacks

VOCAB, LENGTH = 64, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="per-process batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--output-dir", default="/tmp/elasticrun-hf-out", help="checkpoints; shared by every node")
    p.add_argument("--save-steps", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it)")
    return p.parse_args()


class CountingSequences(Dataset):
    """Token sequences that count upwards from a random start (mod the vocabulary):
    the next token is always learnable, so the loss falls fast."""

    def __init__(self, size: int = 4096) -> None:
        starts = torch.randint(VOCAB, (size, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (starts + torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def last_complete_checkpoint(output_dir: Path) -> str | None:
    """The newest checkpoint-N folder whose trainer_state.json is whole, or None."""
    steps = []
    for folder in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        try:
            json.loads((folder / "trainer_state.json").read_text())
        except (OSError, ValueError):
            continue  # still being written, or its writer was killed
        steps.append((int(folder.name.rsplit("-", 1)[1]), folder))
    return str(max(steps)[1]) if steps else None


class Report(TrainerCallback):
    """Rank 0's lines: where this start resumes, then one line per step."""

    def __init__(self, step_time: float) -> None:
        self.step_time = step_time

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if state.is_world_process_zero:
            restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            print(f"start at step {state.global_step}: world size {args.world_size}, "
                  f"restart count {restarts}", flush=True)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        logs: dict[str, float] | None = None, **kwargs: object,
    ) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"Step #{state.global_step}  Loss: {logs['loss']:.5f}  (world size {args.world_size})", flush=True)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        time.sleep(self.step_time)


def main() -> None:
    args = parse_args()
    logging.disable_progress_bar()  # the bar each checkpoint's save draws
    output_dir = Path(args.output_dir)
    on_gpu = torch.cuda.is_available()
    training = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        save_steps=args.save_steps,
        save_total_limit=2,  # the newest, and the one before while the newest is written
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not on_gpu,
        ddp_backend=None if on_gpu else "gloo",
        ddp_find_unused_parameters=False,  # every parameter takes part in every step
        seed=0,
    )
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )
    model = GPT2LMHeadModel(config)
    # elasticrun's callback: each step is progress (--progress-timeout) and a step for the straggler check
    heartbeat = elasticrun.worker.callbacks.huggingface()
    trainer = Trainer(
        model=model, args=training, train_dataset=CountingSequences(), callbacks=[Report(args.step_time), heartbeat]
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts; Report prints one line instead
    resume = last_complete_checkpoint(output_dir) if output_dir.is_dir() else None
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        print(f"done at step {trainer.state.global_step}: world size {training.world_size}", flush=True)


if __name__ == "__main__":
    main()
