"""Infer: generation and exports from base + adapter. mode=infer (`generate.py`) and mode=chat (`chat.py`), what
decides the outputs and the batch the KV cache leaves room for (`sampling.py`), an adapter folder loaded without
unpickling code (`adapter.py`), the merged export that loads elsewhere (`export.py`: the base's own layout, or the
HF-native one of `hf_layout.py`; the adapter converted for an engine in `adapter_export.py`; the vllm serve command
and SERVE.md in `serve_command.py`), where an export may write: never over an input, only over an earlier export
(`targets.py`), and device maps over several GPUs (`devicemap.py`).

May import: glmtune.config, rundir, models, data, plan. Imported by the modes (glmtune/modes/) and serve.
"""
