"""Train: the HF Trainer over glmtune's model, with PEFT LoRA, ZeRO-3 and sequence parallelism. The Trainer and its
arguments (`trainer.py`; the model built as the plan says in `model.py`; the Trainer subclass in `lora_trainer.py`:
one loss per step's tokens in `steps.py`, portable checkpoints in `portable.py`, the optimizer in `optim.py`), LoRA
(`lora.py`), the generated DeepSpeed ZeRO-3 config and adapter fingerprint (`zero3.py`), sequence parallelism in
training (`sequence.py`), compiled blocks and the packed-attention path (`compile.py`); checks before the first
allocation (`preflight.py`); checkpoints complete or ignored (`checkpoints.py`, `saving.py`), the per-step guard for
signals, divergence and timed saves (`guard.py`); evaluation and its metrics (`evaluation.py`, `metrics.py`), logs,
the progress line and trackers (`logs.py`, `progress.py`, `tracking.py`, `losscarry.py`); memory measured per phase
and per step (`phases.py`, `timeline.py`, `gpumem.py`, `livebytes.py`), and the process group a rehearsal runs on
(`rehearsal.py`: rank 0 of a planned world, no data moved).

May import: glmtune.config, launch, rundir, models, data, plan. Imported by probe, scale and the modes.
"""
