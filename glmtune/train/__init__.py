"""Train: the HF Trainer over glmtune's model (`trainer.py`), PEFT LoRA (`lora.py`), the generated DeepSpeed
ZeRO-3 config and adapter fingerprint (`zero3.py`), and the per-step memory timeline (`timeline.py`).

May import: glmtune.config, launch, rundir, models, data, plan. Imported by probe and the CLI.
"""
