"""The GLM-4-0414 family: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1-9B-0414 and GLM-Z1-32B-0414, transformers'
`Glm4ForCausalLM` (`model_type: glm4`) on transformers 4.40.2 with its HF module names: configuration, the decoder
(`modeling.py`, on models/kernels), the fast tokenizer from `tokenizer.json` and the checkpoint's own jinja chat
template (`tokenization.py`, `template.py`), the tiny test checkpoint (`tiny.py`) and what an HF-native export
needs (`export.py`: config, weight names; infer/hf_layout.py exports with them).

May import: glmtune.config and models.kernels. Imported by the shared modules of glmtune.models (loading,
quantize, presets, generation, tokenizer_files), which pick the family from a checkpoint's config.json, and by
infer/hf_layout.py (the export's config).
"""
