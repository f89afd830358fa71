"""What a plan decides and what it reports: the Choices the trainer applies, the Plan around them (plan.json), and
the RunShape the estimator (estimate.py) reads for a run and its choices.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch

from ..config import RunConfig
from ..models.kernels.attnpath import packed_path
from . import sequence
from .estimate import RunShape, gpu_family, image_extra_tokens
from .packrows import fullest_micro_step, most_rows, path_figures
from .reserve import allocator_in_force


@dataclass
class Choices:
    dtype: str  # bf16 | fp16 | fp32: compute dtype and dtype of the frozen weights
    gradient_checkpointing: bool
    zero_stage: int  # 0 (plain data parallel) or 3 (DeepSpeed ZeRO-3)
    offload_params: bool
    offload_optimizer: bool
    micro_batch_size: int
    grad_accum: int
    max_length: int
    world_size: int
    eval_batch_size: int
    loss_chunk_tokens: int = 0  # 0 = reference loss; >0 = chunked loss, fp32 logits for this many tokens at a time
    offload_checkpoints: bool = False  # checkpointed block inputs kept in pinned CPU memory instead of on the GPU
    sequence_parallel: int = 1  # ranks sharing each row (plan/sequence.py); world_size is then processes / N
    mlp_tile_tokens: int = 0  # >0: the MLP runs in token tiles of this size (models/kernels/tiling.py); 0 = whole

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    fits: bool
    budget_bytes: int | None
    peak_bytes: int
    breakdown: dict[str, int]
    choices: Choices
    reasons: dict[str, str]
    advice: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # per breakdown term: measured / CPU-verified / derived
    unmeasured_risk: str = ""  # a near-budget peak that rests on derived terms (plan/provenance.py)
    packing: dict = field(default_factory=dict)  # packed runs: rows per micro-step and step (packing_figures)
    host: dict = field(default_factory=dict)  # one node's RAM: bytes, budget_bytes, fits, breakdown (plan/host.py)

    def to_json(self) -> str:
        keys = (
            "dtype",
            "gradient_checkpointing",
            "zero_stage",
            "offload_params",
            "offload_optimizer",
            "micro_batch_size",
            "grad_accum",
            "max_length",
            "world_size",
            "loss_chunk_tokens",
            "offload_checkpoints",
            "sequence_parallel",
            "mlp_tile_tokens",
        )
        return json.dumps(
            {
                "fits": self.fits,
                "budget_bytes": self.budget_bytes,
                "peak_bytes": self.peak_bytes,
                "breakdown": self.breakdown,
                "choices": {k: getattr(self.choices, k) for k in keys},
                "reasons": self.reasons,
                "advice": self.advice,
                "sources": self.sources,
                "unmeasured_risk": self.unmeasured_risk,
                "packing": self.packing or None,
                "host": self.host or None,
            },
            indent=2,
        )


def packing_figures(
    run: RunConfig, arch, c: Choices, data_max_tokens: int | None, packed: tuple[int, int] | None
) -> dict:
    """How many rows a step becomes when packed (data/packing.py: each micro-batch's examples, first-fit into rows):
    the probed (fullest) micro-step, the most rows any micro-step can make, and per optimizer step."""
    if packed is None:
        return {}
    seq = (min(c.max_length, data_max_tokens) if data_max_tokens else c.max_length) + (
        image_extra_tokens(arch) if arch.vision_config else 0
    )
    layout = fullest_micro_step(c.micro_batch_size, seq, packed[0])
    most = most_rows(c.micro_batch_size, seq, packed[0])
    steps = c.grad_accum * c.world_size  # micro-steps of one optimizer step, over all groups
    return {
        "pack_length": packed[0],
        "examples_per_micro_step": c.micro_batch_size,
        "probed_rows_per_micro_step": layout.rows,
        "probed_row_positions": layout.row_positions,
        "most_rows_per_micro_step": most,
        "micro_steps_per_step": steps,
        "most_rows_per_step": most * steps,
        **path_figures(run.train.packed_attention, layout.row_positions),
    }


def run_shape(
    run: RunConfig,
    arch,
    c: Choices,
    data_max_tokens: int | None = None,
    packed: tuple[int, int] | None = None,
    data_tokens: int = 0,
) -> RunShape:
    """packed: (positions per row, most images in a row) when the data is packed (data/packing.py)."""
    seq = min(c.max_length, data_max_tokens) if data_max_tokens else c.max_length
    images = 1 if arch.vision_config else 0  # GLM-4V: one image per conversation, sized for the worst case
    seq += image_extra_tokens(arch) * images
    micro_batch = c.micro_batch_size
    if packed is not None:  # the micro-batch's examples in rows (plan/packrows.py): the fullest micro-step
        layout = fullest_micro_step(c.micro_batch_size, seq, packed[0])
        micro_batch, seq = layout.rows, layout.row_positions
        images = layout.per_row if arch.vision_config else 0  # the probe's examples each carry an image
    on_gpu = run.hw.memory_gib is not None or torch.cuda.is_available()
    return RunShape(
        dtype=c.dtype,
        micro_batch=micro_batch,
        seq_len=seq,
        lora_r=run.lora.r,
        lora_targets=arch.lora_modules(run.lora.target_modules),
        lora_dropout=run.lora.dropout,
        gradient_checkpointing=c.gradient_checkpointing,
        loss_chunk_tokens=c.loss_chunk_tokens,
        offload_checkpoints=c.offload_checkpoints,
        autocast=c.dtype != "fp32",
        zero_stage=c.zero_stage,
        offload_params=c.offload_params,
        offload_optimizer=c.offload_optimizer,
        images_per_sample=images,
        **sequence.shape_fields(run, c, data_tokens),
        eval_batch=c.eval_batch_size if run.data.val_file or run.data.val_size else 0,
        eval_max_new_tokens=run.eval.max_new_tokens if run.eval.generate else 0,
        device="cuda" if on_gpu else "cpu",
        gpu_family=gpu_family(run.hw.name),
        quantize=run.model.quantize,
        double_quant=run.model.double_quant,
        use_dora=run.lora.use_dora,
        optimizer=run.train.optimizer,
        allocator=allocator_in_force(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
        # Only the dense path has the mask (auto: rows up to DENSE_MASK_MAX). auto may pick FlexAttention
        # only with compiled blocks on CUDA, so it is planned by length, as without them.
        document_mask=packed is not None and packed_path(run.train.packed_attention, seq) == "sdpa",
        mlp_tile_tokens=c.mlp_tile_tokens,
    )
