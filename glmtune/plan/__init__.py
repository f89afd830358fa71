"""Plan: the per-GPU memory estimate and the decisions it drives, from the architecture alone (no weights, no GPU). The
estimator (`estimate.py`, with its terms by concern: `terms.py` a block's and the loss head's tensors, `archsize.py`
sizes, `variants.py` LoRA variants and optimizers, `quantized.py` bitsandbytes weights, `longctx.py` sequence
parallelism, `tiledmlp.py` the tiled MLP, `packrows.py` packed rows, `reserve.py` the allocator's reserve,
`provenance.py` what each term rests on); the planner that picks dtype, checkpointing, loss chunk, ZeRO-3, offload,
sequence parallelism and batch from it (`planner.py`: the Choices, the Plan and the run's shape in `choices.py`, the
reason for each decision in `reasons.py`, the sequence-parallel rung in `sequence.py`), the node's host RAM, the
second budget (`host.py`), what would fit when nothing does (`advice.py`), a resume on other hardware (`elastic.py`)
and the plan's table (`table.py`).

May import: glmtune.config, glmtune.models. Imported by probe, train, infer, serve and the modes.
"""
