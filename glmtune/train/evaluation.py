"""What an evaluation reports besides the Trainer's eval loss, and what the run does with it.

- perplexity: exp(eval loss). The eval loss is the Trainer's mean of per-batch mean token losses, so this is
  the perplexity of that mean (batches with fewer answer tokens weigh a little more than per token). Under
  dist.sequence_parallel the same loss, scored from the shards of each batch (train/sequence.py).
- with eval.generate: a greedy reply to each validation example, scored as the official GLM-4 demo scores
  it (metrics.py). Like the demo's eval set, every assistant turn of a conversation is one example: the
  prompt is everything before it, the reference its text (a tool call: `name\\n{arguments}`).
  Every rank generates for the same examples (under ZeRO-3 with synced forward steps, since each step
  gathers weights from all ranks); rank 0's numbers are the ones logged.
- the best evaluation by eval.metric_for_best: that step's checkpoint is saved, copied to
  <run dir>/adapter_best at the end, and eval.early_stopping_patience evaluations without improvement end
  the run.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from ..config import EVAL_METRICS, EvalConfig, InferConfig
from ..data.validate import read_conversations
from ..models.chatglm.template import reference_text
from ..models.generation import generate
from .metrics import generation_metrics

MAX_LOG_PERPLEXITY = 50.0  # exp(50) ~ 5e21: beyond this the number says only "untrained", and exp overflows later


def perplexity(eval_loss: float) -> float:
    return math.exp(min(eval_loss, MAX_LOG_PERPLEXITY))


def eval_examples(
    val_file: str | list[tuple[str, list[int]]], limit: int = 0, fmt: str = "auto"
) -> list[tuple[int, list[dict], str]]:
    """(line, prompt messages, reference text) for every assistant turn of the val file, the first `limit`;
    fmt: data.format. val_file may also be (train file, line numbers) pairs: a val set held out by data.val_size
    (data/mixing.py Selection.sources)."""
    if isinstance(val_file, str):
        conversations = read_conversations(val_file, "data.val_file", fmt=fmt)
    else:
        conversations = [
            c
            for path, lines in val_file
            for wanted in [set(lines)]
            for c in read_conversations(path, "data.train_file", fmt=fmt)
            if c.line in wanted
        ]
    examples = []
    for conversation in conversations:
        for i, message in enumerate(conversation.messages):
            if message["role"] == "assistant" and i > 0:
                examples.append((conversation.line, conversation.messages[:i], reference_text(message)))
    return examples[:limit] if limit else examples


class GenerationEval:
    """Generates for the validation examples and scores the replies; writes each evaluation's predictions."""

    def __init__(
        self,
        cfg: EvalConfig,
        val_file: str | list[tuple[str, list[int]]],
        tokenizer,
        batch_size: int,
        out_dir: Path,
        synced_gpus: bool = False,
        fmt: str = "auto",
    ):
        self.examples = eval_examples(val_file, cfg.max_examples, fmt)
        self.tokenizer, self.out_dir, self.synced_gpus = tokenizer, Path(out_dir), synced_gpus
        self.decoding = InferConfig(max_new_tokens=cfg.max_new_tokens, batch_size=batch_size)  # greedy

    def __call__(self, model, step: int, write: bool) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            predictions = generate(
                model, self.tokenizer, [p for _, p, _ in self.examples], self.decoding, synced_gpus=self.synced_gpus
            )
        finally:
            model.train(was_training)
        references = [r for _, _, r in self.examples]
        if write:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.out_dir / f"eval_predictions_step{step}.jsonl").open("w", encoding="utf-8") as f:
                for (line, prompt, reference), output in zip(self.examples, predictions):
                    f.write(
                        json.dumps(
                            {"line": line, "prompt": prompt, "reference": reference, "output": output},
                            ensure_ascii=False,
                        )
                        + "\n"
                    )
        return {f"eval_{k}": v for k, v in generation_metrics(predictions, references).items()}


class BestTracker:
    """Follows eval.metric_for_best over the evaluations; asks the Trainer to save a checkpoint on each new best
    and to stop after `patience` evaluations without one."""

    def __init__(self, cfg: EvalConfig):
        self.metric, self.higher = cfg.metric_for_best, EVAL_METRICS[cfg.metric_for_best]
        self.patience = cfg.early_stopping_patience
        self.best: float | None = None
        self.step: int | None = None
        self.since_best = 0
        self.stopped_early = False

    def update(self, metrics: dict, step: int, control=None) -> bool:
        """True when this evaluation is the best so far."""
        value = metrics.get(self.metric)
        if value is None:
            return False
        better = self.best is None or (value > self.best if self.higher else value < self.best)
        if better:
            self.best, self.step, self.since_best = value, step, 0
            if control is not None:
                control.should_save = True  # the Trainer saves checkpoints/checkpoint-<step> after this evaluation
            return True
        self.since_best += 1
        if control is not None and self.patience and self.since_best >= self.patience:
            control.should_training_stop = True
            self.stopped_early = True
        return False

    def summary(self) -> dict:
        return {"metric": self.metric, "value": self.best, "step": self.step, "stopped_early": self.stopped_early}


def keep_best_adapter(
    tracker: BestTracker, checkpoints: Path, final_adapter: Path, final_step: int, out: Path
) -> Path | None:
    """Copy the best evaluation's adapter to `out` (from its checkpoint, or the final adapter)."""
    if tracker.step is None:
        return None
    source = final_adapter if tracker.step == final_step else checkpoints / f"checkpoint-{tracker.step}"
    files = list(source.glob("adapter_*")) + list(final_adapter.glob("glmtune_base.json"))
    if not files:
        return None
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, out / f.name)
    return out
