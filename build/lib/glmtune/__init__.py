"""glmtune: LoRA fine-tuning of GLM-4 / GLM-4V / ChatGLM3 that plans and probes GPU memory before it runs."""

__version__ = "0.1.0"
