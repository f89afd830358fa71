"""Run decisions: dtype, checkpointing, ZeRO stage, offload, micro-batch, accumulation, max length.

`Choices` is what the trainer applies. `make_plan` fills it from the memory estimator (estimate.py): it
starts from the fastest configuration and walks down `step_down`'s ladder (smaller micro-batch with
more accumulation, chunked loss, checkpointing, checkpoint offload, ZeRO-3) until the estimate fits under
budget = hw.memory_gib x margin. Without a budget (no preset, no GPU) everything fits and the plan
still reports the estimate.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

import torch

from ..config import ConfigError, RunConfig
from ..models.kernels.attnpath import packed_path
from .advice import advise
from ..config.units import GIB
from .estimate import RunShape, estimate, gpu_family, image_extra_tokens
from .packrows import fullest_micro_step, most_rows, path_figures, path_reason
from ..config import userds
from .provenance import derived_near_budget, term_sources
from .quantized import allows_zero3
from .tiledmlp import tile_tokens
from .reserve import ALLOCATORS, allocator_in_force
from . import longctx, sequence
from .host import host_figures, host_reason

DEFAULT_MAX_LENGTH = 500
LOSS_CHUNK = 1024  # tokens per chunk of the lower-memory loss: 1024 x 151,552 x 12 B = 1.9 GB peak
LOSS_CHUNK_SMALL = 256  # the next rung: 0.47 GB; the head matmul per chunk is still 256 x 4096 x 151,552
DEFAULT_EVAL_NEW_TOKENS = 512  # the GLM-4 demo's generation_config.max_new_tokens


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
        keys = ("dtype", "gradient_checkpointing", "zero_stage", "offload_params", "offload_optimizer",
                "micro_batch_size", "grad_accum", "max_length", "world_size", "loss_chunk_tokens",
                "offload_checkpoints", "sequence_parallel", "mlp_tile_tokens")
        return json.dumps({"fits": self.fits, "budget_bytes": self.budget_bytes, "peak_bytes": self.peak_bytes,
                           "breakdown": self.breakdown, "choices": {k: getattr(self.choices, k) for k in keys},
                           "reasons": self.reasons, "advice": self.advice, "sources": self.sources,
                           "unmeasured_risk": self.unmeasured_risk, "packing": self.packing or None,
                           "host": self.host or None}, indent=2)


def plan_world(run: RunConfig, processes: int) -> int:
    """The processes a plan is for: dist.nnodes x dist.nproc_per_node for mode=plan and for a rehearsal, else the
    `processes` of the launch."""
    if run.mode == "plan":
        return run.dist.nnodes * run.dist.nproc_per_node
    return rehearsed_world(run, processes) or processes


def rehearsed_world(run: RunConfig, processes: int) -> int:
    """The ranks mode=probe rehearses in this process (probe/rehearse.py: rank 0 of them on this one device), or 0
    for a real probe of the `processes` running (and for every other mode)."""
    setting, planned = run.probe.rehearse, run.dist.nnodes * run.dist.nproc_per_node
    if setting is False or run.mode != "probe":
        return 0
    if processes > 1:
        if setting is True:
            raise ConfigError(f"probe.rehearse=true rehearses a plan in one process, and this launch has {processes}: "
                              "run mode=probe without torchrun (dist.nproc_per_node=N names the GPUs it plans for), "
                              "or probe.rehearse=auto to probe the processes running")
        return 0
    return planned if setting is True or planned > 1 else 0


def local_dtype(run: RunConfig) -> tuple[str, str]:
    """bf16 where the device supports it, fp16 with loss scaling on GPUs without it, fp32 on CPU."""
    if run.train.precision != "auto":
        return run.train.precision, "set by train.precision"
    if run.hw.memory_gib is None and not torch.cuda.is_available():
        return "fp32", "no GPU: fp32 (bf16 autocast on CPU is slow and gains no memory that matters here)"
    if run.hw.bf16 and (run.hw.memory_gib is not None or torch.cuda.is_bf16_supported()):
        return "bf16", "the card supports bfloat16: half the memory of fp32, no loss scaling needed"
    return "fp16", "no bfloat16 on this card: fp16 with dynamic loss scaling"


def packing_figures(run: RunConfig, arch, c: Choices, data_max_tokens: int | None,
                    packed: tuple[int, int] | None) -> dict:
    """How many rows a step becomes when packed (data/packing.py: each micro-batch's examples, first-fit into rows):
    the probed (fullest) micro-step, the most rows any micro-step can make, and per optimizer step."""
    if packed is None:
        return {}
    seq = (min(c.max_length, data_max_tokens) if data_max_tokens else c.max_length) + \
        (image_extra_tokens(arch) if arch.vision_config else 0)
    layout = fullest_micro_step(c.micro_batch_size, seq, packed[0])
    most = most_rows(c.micro_batch_size, seq, packed[0])
    steps = c.grad_accum * c.world_size  # micro-steps of one optimizer step, over all groups
    return {"pack_length": packed[0], "examples_per_micro_step": c.micro_batch_size,
            "probed_rows_per_micro_step": layout.rows, "probed_row_positions": layout.row_positions,
            "most_rows_per_micro_step": most, "micro_steps_per_step": steps,
            "most_rows_per_step": most * steps, **path_figures(run.train.packed_attention, layout.row_positions)}


def run_shape(run: RunConfig, arch, c: Choices, data_max_tokens: int | None = None,
              packed: tuple[int, int] | None = None, data_tokens: int = 0) -> RunShape:
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
    return RunShape(dtype=c.dtype, micro_batch=micro_batch, seq_len=seq,
                    lora_r=run.lora.r, lora_targets=arch.lora_modules(run.lora.target_modules),
                    lora_dropout=run.lora.dropout,
                    gradient_checkpointing=c.gradient_checkpointing, loss_chunk_tokens=c.loss_chunk_tokens,
                    offload_checkpoints=c.offload_checkpoints, autocast=c.dtype != "fp32",
                    zero_stage=c.zero_stage, offload_params=c.offload_params, offload_optimizer=c.offload_optimizer,
                    images_per_sample=images, **sequence.shape_fields(run, c, data_tokens),
                    eval_batch=c.eval_batch_size if run.data.val_file or run.data.val_size else 0,
                    eval_max_new_tokens=run.eval.max_new_tokens if run.eval.generate else 0,
                    device="cuda" if on_gpu else "cpu", gpu_family=gpu_family(run.hw.name),
                    quantize=run.model.quantize, double_quant=run.model.double_quant, use_dora=run.lora.use_dora,
                    optimizer=run.train.optimizer, allocator=allocator_in_force(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
                    # Only the dense path has the mask (auto: rows up to DENSE_MASK_MAX). auto may pick FlexAttention
                    # only with compiled blocks on CUDA, so it is planned by length, as without them.
                    document_mask=packed is not None and packed_path(run.train.packed_attention, seq) == "sdpa",
                    mlp_tile_tokens=c.mlp_tile_tokens)


def step_down(plan_or_choices: Plan | Choices, run: RunConfig, arch, world_size: int) -> Choices | None:
    """The next, slower but smaller configuration, or None when the ladder is exhausted.

    Rungs, cheapest first (cost measured on an H100, bench/RESULTS.md): halve the micro-batch (doubling
    accumulation, same global batch); chunked loss (1,024 tokens: one extra head matmul per chunk, ~2 % of a
    step); checkpointing (unless forced off: one extra forward, ~25-30 %); a 256-token loss chunk; checkpointed
    block inputs in pinned CPU memory (40 x tokens x 4096 x 2 B leave the card: 2.5 GiB at 8K; two PCIe copies
    per block and step, overlapped with compute); ZeRO-3 (world_size > 1, unless dist.strategy=ddp: weights
    gathered every step, 6x slower than plain LoRA on one H100 even without a second GPU to talk to; before
    sequence parallelism because that shards activations, never the weights); under sequence_parallel=auto the
    next degree (plan/sequence.py: 1/N of the activations, accumulation x N; 12 exchanges of q, k, v and the
    output per block and step: 1.6 % of a CPU step at SP 2, 5.9 % at SP 4 over gloo, bench/RESULTS.md); last,
    the tiled MLP (one more MLP forward per step: derived ~+18 % at 8K, ~+6 % at 128K, more than SP's
    exchanges; only when a rank's micro-batch outgrows a tile). The optimizer is never
    offloaded: LoRA's Adam states are megabytes. Nor are the parameters: measured on an H100, DeepSpeed
    0.19.8's parameter offload still held the whole model on the card (bench/RESULTS.md), so it fits
    nothing that ZeRO-3 without it does not."""
    c = plan_or_choices.choices if isinstance(plan_or_choices, Plan) else plan_or_choices
    ckpt_allowed = run.train.gradient_checkpointing != "off"
    if c.micro_batch_size > 1:
        return replace(c, micro_batch_size=c.micro_batch_size // 2, grad_accum=c.grad_accum * 2)
    if c.loss_chunk_tokens == 0:
        return replace(c, loss_chunk_tokens=LOSS_CHUNK)
    if not c.gradient_checkpointing and ckpt_allowed:
        return replace(c, gradient_checkpointing=True)
    if c.loss_chunk_tokens > LOSS_CHUNK_SMALL:
        return replace(c, loss_chunk_tokens=LOSS_CHUNK_SMALL)
    if c.gradient_checkpointing and not c.offload_checkpoints:
        return replace(c, offload_checkpoints=True)
    if c.zero_stage == 0 and max(world_size, c.world_size) * c.sequence_parallel > 1 and allows_zero3(run):
        return replace(c, zero_stage=3)
    wider = sequence.next_degree(c, run, arch)
    if wider is not None:
        return wider
    tile = tile_tokens(arch)  # plan/tiledmlp.py
    local = c.micro_batch_size * longctx.shard_length(c.max_length, c.sequence_parallel)  # a rank's tokens
    if run.train.tiled_mlp == "auto" and c.mlp_tile_tokens == 0 and local > tile:
        return replace(c, mlp_tile_tokens=tile)
    return None


def _budget(run: RunConfig, margin: float) -> int | None:
    if run.hw.memory_gib is not None:
        return int(run.hw.memory_gib * GIB * margin)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory * margin)
    return None


def make_plan(run: RunConfig, arch, world_size: int, user_set_max_length: bool,
              data_max_tokens: int | None = None, margin: float | None = None,
              packed: tuple[int, int] | None = None, advice: bool = True, data_tokens: int = 0,
              user_ds: userds.UserDeepSpeed | None = None) -> Plan:
    """world_size: the processes of the launch; the plan's width (Choices.world_size) is that over the
    sequence-parallel degree. data_tokens: the tokenized set's size, for the host budget (0 = unknown).
    user_ds: dist.deepspeed_config as config/userds.load read it; the plan starts from its offloads."""
    budget = _budget(run, run.hw.margin if margin is None else margin)
    processes, sp = world_size, sequence.first_degree(run, arch, world_size)
    world_size = processes // sp
    dtype, why_dtype = local_dtype(run)
    max_length = run.data.max_length if user_set_max_length else DEFAULT_MAX_LENGTH
    c = Choices(dtype=dtype, gradient_checkpointing=run.train.gradient_checkpointing == "on",
                zero_stage=3 if run.dist.strategy == "zero3" else 0,  # the offloads: the user's file's, else none
                offload_params=bool(user_ds and user_ds.offload_params),
                offload_optimizer=bool(user_ds and user_ds.offload_optimizer),
                micro_batch_size=run.train.per_device_batch_size, grad_accum=run.train.grad_accum,
                max_length=max_length, world_size=world_size, eval_batch_size=run.train.eval_batch_size,
                sequence_parallel=sp,
                mlp_tile_tokens=tile_tokens(arch) if run.train.tiled_mlp == "on" else 0)
    reasons = {"dtype": why_dtype,
               "max_length": "set by data.max_length" if user_set_max_length else
               f"default {DEFAULT_MAX_LENGTH} tokens (data.max_length not set)"}

    def peak(ch: Choices, evaluating: bool = True):
        shape = run_shape(run, arch, ch, data_max_tokens, packed, data_tokens)
        return estimate(arch, shape if evaluating else replace(shape, eval_batch=0))

    def fits(ch: Choices, evaluating: bool = True) -> bool:
        est = None if budget is None else peak(ch, evaluating)  # and one node's RAM: the second budget
        return est is None or (est.peak_bytes <= budget and host_figures(est, run, True)["fits"])

    # Frozen weights alone exceed one card: only ZeRO-3 over several GPUs shards them.
    weights_only = peak(c).breakdown.get("frozen weights", 0)
    if (budget is not None and weights_only > budget and processes > 1 and run.dist.strategy == "auto"
            and allows_zero3(run)):
        c = replace(c, zero_stage=3)
    start = c
    # Training first: a smaller evaluation batch costs the training nothing, so it must not push the
    # training down the ladder. Then halve the evaluation batch until it fits too, and only if evaluating one
    # example at a time still does not fit, go further down (a smaller loss chunk helps evaluation as well).
    for evaluating in (False, True):
        while not fits(c, evaluating):
            if evaluating and c.eval_batch_size > 1:
                c = replace(c, eval_batch_size=c.eval_batch_size // 2)
                continue
            nxt = step_down(c, run, arch, c.world_size)
            if nxt is None:
                break
            c = nxt
    if c.offload_checkpoints and not fits(c) and fits(replace(c, offload_checkpoints=False)):
        c = replace(c, offload_checkpoints=False)  # a later rung made the offload unneeded, and the host is short
    est = peak(c)
    host = host_figures(est, run, budget is not None)
    ok = (budget is None or est.peak_bytes <= budget) and host["fits"]
    reasons.update(_reasons(run, start, c, budget, weights_only, processes, ok))
    reasons["sequence_parallel"] = sequence.reason(run, arch, c, processes)
    reasons["host"] = host_reason(host, sequence.shape_fields(run, c, 0)["ranks_per_node"])
    sources = term_sources(est.breakdown, run_shape(run, arch, c, data_max_tokens, packed))
    plan = Plan(ok, budget, est.peak_bytes, est.breakdown, c, reasons, sources=sources,
                unmeasured_risk=derived_near_budget(est.breakdown, sources, est.peak_bytes, budget) if ok else "",
                packing=packing_figures(run, arch, c, data_max_tokens, packed), host=host)
    if plan.packing:
        reasons["packed_attention"] = path_reason(run.train.packed_attention, plan.packing)
    if not ok and advice and budget is not None:  # the options are other cards and levers for a card budget
        plan.advice = _advice(run, arch, processes, c.max_length, data_max_tokens, margin, packed, data_tokens, user_ds)
    return plan


def _reasons(run, start: Choices, c: Choices, budget, weights: int, world_size: int,
             fits: bool = True) -> dict[str, str]:
    gib = (lambda x: f"{x / GIB:.1f} GiB")
    r = {}
    r["gradient_checkpointing"] = (f"train.gradient_checkpointing={run.train.gradient_checkpointing}"
                                   if run.train.gradient_checkpointing != "auto" else
                                   "on: activations of every block do not fit" if c.gradient_checkpointing else
                                   "off: activations fit, no recompute cost")
    if run.dist.strategy != "auto":
        r["zero_stage"] = f"dist.strategy={run.dist.strategy}"
    elif c.zero_stage == 3 and budget is not None and weights > budget:
        r["zero_stage"] = f"3: frozen weights {gib(weights)} exceed the {gib(budget)} budget; sharded over {world_size} GPUs"
    else:
        r["zero_stage"] = ("3: needed to fit" if c.zero_stage == 3 else
                           "0: plain data parallel fits (ZeRO-1/2 shard nothing useful for LoRA)" if fits else
                           "0: nothing fits this card set (see the advice)")
    r["loss_chunk_tokens"] = (f"{c.loss_chunk_tokens}: the full fp32 logits do not fit" if c.loss_chunk_tokens
                              else "0: reference loss fits")
    r["offload_checkpoints"] = ("on: the checkpointed block inputs do not fit; they wait in pinned CPU memory "
                                "(two PCIe copies per block and step)" if c.offload_checkpoints else "off")
    r["mlp_tile_tokens"] = (f"train.tiled_mlp={run.train.tiled_mlp}" if run.train.tiled_mlp != "auto" else
                            f"{c.mlp_tile_tokens}: the MLP's intermediate (tokens x 2 ffn) does not fit; one tile's "
                            "does (one more MLP forward per step)" if c.mlp_tile_tokens else "0: the whole MLP fits")
    r["offload_params"] = ("off: DeepSpeed's parameter offload kept the whole model on the card when measured "
                           "(H100, deepspeed 0.19.8)")
    r["micro_batch_size"] = sequence.batch_reason(start, c)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    allocator = allocator_in_force(conf)
    r["allocator"] = (f"{ALLOCATORS[allocator]} (PYTORCH_CUDA_ALLOC_CONF="
                      f"{conf if conf is not None else 'unset: glmtune sets expandable_segments:True'})"
                      + ("" if allocator == "expandable" else
                         "; its reserve is planned larger (up to 1.21 x at an evaluation after training, measured)"))
    r["eval_batch_size"] = ("halved until evaluation, with its own allocator reserve, fits" if c.eval_batch_size < start.eval_batch_size
                            else "train.eval_batch_size")
    if c.sequence_parallel > 1 and (run.data.val_file or run.data.val_size):  # train/sequence.py
        r["eval_batch_size"] += (f"; the eval loss is sharded over each group's {c.sequence_parallel} GPUs"
                                 " like training" + ("; eval.generate decodes whole rows on every GPU (a KV cache "
                                 "grows token by token, it is not cut), its cache budgeted at the whole prompt + "
                                 "eval.max_new_tokens" if run.eval.generate else ""))
    return r


def _advice(run, arch, world_size: int, max_length: int, data_max_tokens, margin,
            packed: tuple[int, int] | None = None, data_tokens: int = 0, user_ds=None) -> list[str]:
    """The overrides that would fit, each one planned again (plan/advice.py); empty when none does."""
    def replan(changed: RunConfig, world: int) -> Plan:
        return make_plan(changed, arch, world, True, data_max_tokens, margin, packed, False, data_tokens, user_ds)

    return advise(run, world_size, max_length, replan)
