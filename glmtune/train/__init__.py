"""Train: the HF Trainer over glmtune's model (`trainer.py`), PEFT LoRA (`lora.py`), the generated DeepSpeed
ZeRO-3 config and adapter fingerprint (`zero3.py`), the per-step memory timeline (`timeline.py`), and the process
group a rehearsal runs on (`rehearsal.py`: rank 0 of a planned world, no data moved).

May import: glmtune.config, launch, rundir, models, data, plan. Imported by probe and the CLI.
"""
