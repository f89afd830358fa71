"""The Trainer's progress bar with glmtune's own lines: `step 5: loss 7.4731, lr 4.5e-04, epoch 0.10` instead of
the Python dict the Trainer writes under it, and no dict of train_runtime/samples_per_second at the end (the
closing line and metrics.json carry those). Every value is also in metrics.jsonl and TensorBoard."""
from __future__ import annotations

from transformers import ProgressCallback

_SHORT = {"learning_rate": "lr", "grad_norm": "grad norm", "num_input_tokens_seen": "tokens"}


def step_line(step: int, logs: dict) -> str:
    parts = []
    for key, value in logs.items():
        if "runtime" in key or key.endswith("per_second"):  # timings of one evaluation: in metrics.jsonl
            continue
        name = _SHORT.get(key, key.replace("eval_", "eval "))
        if isinstance(value, float):
            text = (f"{value:.2e}" if key == "learning_rate" else f"{value:.2f}" if key == "epoch" else
                    f"{value:.4f}" if key.endswith("loss") else f"{value:.4g}")
        else:
            text = str(value)
        parts.append(f"{name} {text}")
    return f"step {step}: " + ", ".join(parts)


class StepLines(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        line = step_line(state.global_step, {k: v for k, v in logs.items()
                                             if k != "total_flos" and not k.startswith("memory/")})
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)
