"""What a person reads on the console: a few header lines before the run, one summary line after it.

The whole composed config is in <run dir>/.hydra/config.yaml (and `glmtune --cfg job` prints it); the
header keeps what decides a run: model, data, card and budget, the plan's decisions, and how many optimizer
steps the run will take, so a run that trains 40 steps of a 3-epoch request cannot pass unnoticed. A full
disk's one line names the file and folder it hit and whether a re-run resumes.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from ..config import EVAL_METRICS, SAMPLE_SETS, DataConfig, RunConfig, TrainConfig, train_files
from ..config.units import GIB
from ..launch import rank
from ..launch.console import LOG_WIDTH, console
from ..launch.exits import ERROR_PREFIX
from ..plan.planner import Choices, Plan
from ..rundir.atomic import write_json
from ..train.checkpoints import last_complete


def optimizer_steps(cfg: TrainConfig, choices: Choices, examples: int) -> tuple[int, float]:
    """(optimizer steps, epochs) as the HF Trainer 4.40 counts them for `examples` training examples.

    Each rank gets ceil(batches / world) micro-batches of an epoch (accelerate shards the batches), an epoch
    is max(those // grad_accum, 1) steps, and without train.max_steps the run is ceil(epochs x that) steps."""
    batches = math.ceil(math.ceil(examples / choices.micro_batch_size) / choices.world_size)
    per_epoch = max(batches // choices.grad_accum, 1)
    if cfg.max_steps > 0:
        return cfg.max_steps, cfg.max_steps / per_epoch
    return math.ceil(cfg.num_epochs * per_epoch), cfg.num_epochs


def _card(run: RunConfig, plan: Plan) -> str:
    if plan.budget_bytes is None:
        return f"{run.hw.name}: CPU, no memory budget"
    size = f"{run.hw.memory_gib} GiB" if run.hw.memory_gib is not None else "this GPU's memory"
    return f"{run.hw.name}: {size} x margin {run.hw.margin} = {plan.budget_bytes / GIB:.1f} GiB budget per GPU"


def _decisions(c: Choices) -> str:
    parts = [
        c.dtype,
        f"checkpointing {'on' if c.gradient_checkpointing else 'off'}",
        "ZeRO-3" if c.zero_stage == 3 else "no ZeRO",
    ]
    if c.offload_params:
        parts.append("CPU offload")
    if c.loss_chunk_tokens:
        parts.append(f"chunked loss ({c.loss_chunk_tokens} tokens)")
    if c.mlp_tile_tokens:
        parts.append(f"tiled MLP ({c.mlp_tile_tokens}-token tiles)")
    # Under sequence parallelism the plan's width is the number of groups, each sharing its rows over N GPUs.
    sp = c.sequence_parallel
    width = (
        f"{c.world_size} GPU(s)"
        if sp == 1
        else f"{c.world_size} group(s) of {sp} GPUs sharing each row (dist.sequence_parallel)"
    )
    parts.append(
        f"micro-batch {c.micro_batch_size} x accum {c.grad_accum} x {width} = global batch "
        f"{c.micro_batch_size * c.grad_accum * c.world_size}"
    )
    return ", ".join(parts)


def val_line(data: DataConfig) -> str:
    """What the run evaluates on: the header says it, since a user's own train file no longer pairs with the
    bundled val set (config/samples.py) and a run without one keeps no adapter_best/."""
    if data.val_file:
        bundled = data.val_file in (f"data/{name}/val.jsonl" for name in SAMPLE_SETS)
        return data.val_file + (" (the bundled sample val set)" if bundled else "")
    if data.val_size:
        held = f"{data.val_size * 100:g}% of" if data.val_size < 1 else f"{data.val_size:g} of"
        return f"{held} the train examples held out (data.val_size={data.val_size:g})"
    return "none (data.val_file or data.val_size to evaluate)"


def header(run: RunConfig, plan: Plan, run_dir: Path | None, train_examples: int | None = None) -> str:
    """Plain lines (no markup) for the console before the probe and the training."""
    if run.model.path:
        model = f"{run.model.name} from {run.model.path}"
    elif run.model.name.endswith("_tiny"):
        model = f"{run.model.name} (built-in random tiny model)"
    else:
        model = f"{run.model.name} (architecture facts only: training needs model.path)"
    if run.model.quantize != "none":  # QLoRA: the numerics change, so the header says it (conf/model: opt-in)
        model += f", base weights in {run.model.quantize} (bitsandbytes" + (
            ", double quant)" if run.model.quantize == "nf4" and run.model.double_quant else ")"
        )
    files = train_files(run.data)
    data = ", ".join(files) + (f" mixed {':'.join(f'{w:g}' for w in run.data.mix)}" if run.data.mix else "")
    where = (
        f"run dir {run_dir}  (full config: .hydra/config.yaml)"
        if run_dir
        else "nothing written (hydra.run.dir=DIR keeps plan.json)"
    )
    lines = [
        f"glmtune {run.mode}: {where}",
        f"  model  {model}",
        f"  data   {data}, max_length {plan.choices.max_length}",
        f"  val    {val_line(run.data)}",
        f"  card   {_card(run, plan)}",
        f"  plan   {_decisions(plan.choices)}; planned peak {plan.peak_bytes / GIB:.2f} GiB "
        + ("per GPU (estimate)" if plan.budget_bytes is not None else "(estimate, tensors on CPU)")
        + ("" if plan.fits else "  DOES NOT FIT"),
    ]
    if plan.budget_bytes is not None and "host" in plan.reasons:  # a GPU plan: one node's RAM, the second budget
        lines.append(f"  host   {plan.reasons['host']}")
    if plan.budget_bytes is not None and "allocator" in plan.reasons:  # a GPU plan: the reserve it assumes
        lines.append(f"  alloc  {plan.reasons['allocator']}")
    if train_examples is not None and run.mode == "train":
        steps, epochs = optimizer_steps(run.train, plan.choices, train_examples)
        why = (
            f"train.max_steps={run.train.max_steps}: {epochs:.2f} epochs"
            if run.train.max_steps > 0
            else f"{epochs:g} epoch(s)"
        )
        lines.append(f"  steps  {steps} optimizer steps ({why} of {train_examples} examples)")
    # 120 columns, continued under the value: a log file or CI page shows it whole (a path is never split)
    return "\n".join(
        textwrap.fill(line, LOG_WIDTH, subsequent_indent=" " * 9, break_long_words=False, break_on_hyphens=False)
        for line in lines
    )


def plan_written(run: RunConfig, plan: Plan, arch, overrides: list[str], run_dir: Path) -> str:
    """mode=plan's closing lines: where plan.json is and, with plan.emit, the cluster objects that run the plan."""
    line = f"plan written to {run_dir / 'plan.json'}"
    if not run.plan.emit:
        return line
    from ..scale.trainjob import emit  # the Kubeflow SDK's models (~1 s to import): for plan.emit only

    return f"{line}\n{emit(run, plan, arch, overrides, run_dir)}"


def report_probe(report, run_dir: Path, planned_bytes: int | None = None) -> None:
    """probe.json in the run dir and the predicted-vs-measured table on the console (rank 0), then what the probe
    measured beside the header's planned peak."""
    if rank() != 0:
        return
    from ..probe.table import format_probe  # the probe imports the Trainer stack, which mode=plan does not need

    write_json(run_dir / "probe.json", report.to_dict())
    console.print(format_probe(report))
    if report.measured_peak_bytes is not None:
        console.print(probe_line(report, planned_bytes), markup=False)


def probe_line(report, planned_bytes: int | None) -> str:
    """The probe's peak named by what it measures, beside the header's planned peak: on a CPU probing a card's
    plan the two differ by what only a GPU holds (the plan's CUDA context, workspaces and allocator reserve)."""
    on_gpu = report.method.startswith("whole process")
    line = (
        f"probe measured peak {report.measured_peak_bytes / GIB:.2f} GiB "
        f"({'whole GPU process' if on_gpu else 'live tensors on CPU'}), predicted "
        f"{report.predicted_peak_bytes / GIB:.2f} GiB for this device"
    )
    if planned_bytes is not None and not on_gpu and report.budget_bytes is not None:
        line += (
            f"; the planned peak {planned_bytes / GIB:.2f} GiB per GPU adds what only a GPU holds (CUDA context, "
            "cuBLAS workspaces, allocator reserve)"
        )
    return textwrap.fill(line, LOG_WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def summary(metrics: dict, wall_s: float) -> str:
    """Three lines after training, each within a 120-column log (a longer one wraps, a path never split): what the
    run did (steps, losses, metrics, throughput), its measured memory, where the adapters are."""
    result = [
        f"done in {wall_s:.0f} s: {metrics['steps']} steps ({metrics.get('epochs', 0):.2f} epochs)",
        f"train loss {metrics['train_loss']:.4f}",
    ]
    if "eval_loss" in metrics:
        result.append(
            f"eval loss {metrics['eval_loss']:.4f} (perplexity {math.exp(min(metrics['eval_loss'], 50)):.1f})"
        )
    generated = [
        f"{k.removeprefix('eval_')} {metrics[k]:.4g}"
        for k in EVAL_METRICS
        if k in metrics and k not in ("eval_loss", "eval_perplexity")
    ]
    if generated:  # eval.generate: ROUGE/BLEU/exact match of the last evaluation
        result.append(", ".join(generated))
    if metrics.get("tokens_per_s"):
        result.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
    memory = []
    phases = metrics.get("phase_peak_bytes")
    if phases:  # measured as the probe measured: the figure its certificate is about
        memory.append(
            f"peak {max(phases.values()) / GIB:.2f} GiB ({metrics['phase_peak_kind']}; "
            + ", ".join(f"{p} {b / GIB:.2f}" for p, b in phases.items())
            + ")"
            + (f", {metrics['over_probe']:.1%} over the probe's" if metrics.get("over_probe") else "")
        )
    if metrics.get("measured_peak_bytes") and not (phases and metrics.get("peak_kind", "").startswith("GPU")):
        memory.append(
            f"{'' if phases else 'peak '}{metrics['measured_peak_bytes'] / GIB:.2f} GiB ({metrics['peak_kind']})"
        )
    saved = f"adapter saved to {metrics['adapter_dir']}"
    best = metrics.get("best") or {}
    if best.get("adapter_dir"):  # with a val set: the best evaluation's adapter, kept beside the last one
        kept = Path(best["adapter_dir"])
        where = f"{kept.name}/" if kept.parent == Path(metrics["adapter_dir"]).parent else str(kept)
        saved += f"; best {best['metric']} {best['value']:.4g} at step {best['step']} in {where}"
    lines = [", ".join(result), *([", ".join(memory)] if memory else []), saved]
    return "\n".join(
        textwrap.fill(
            line,
            LOG_WIDTH,
            initial_indent="" if i == 0 else "  ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for i, line in enumerate(lines)
    )


def crash_line(crash: BaseException) -> str:
    """'Type: the first line of its message', for the one line a crash gets on the console."""
    message = str(crash).strip()
    return f"{type(crash).__name__}: {message.splitlines()[0][:200] if message else '(no message)'}"


def disk_full_line(err: BaseException, run_dir: Path) -> str:
    """The one line for a write that found the disk full: the file and folder it was writing (from the error
    chain; the run dir when no error names one), and whether a re-run resumes or starts again."""
    named, link, seen = None, err, set()
    while link is not None and id(link) not in seen and named is None:
        seen.add(id(link))
        named = getattr(link, "filename", None)
        link = link.__cause__ or link.__context__
    reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    where = f"{named} in {Path(named).parent}" if named else f"a run file in {run_dir}"
    last = last_complete(run_dir / "checkpoints") if run_dir.is_dir() else None
    then = f"it resumes from {last}" if last else "nothing was saved yet, so it starts again"
    return (
        f"disk full or over quota writing {where} ({reason}) — free space there, then re-run the same command: {then}"
    )


def no_fit_line(plan) -> str:
    """Exit 3's line: the best option's overrides where the line stays within a 120-column log (a sweep's record
    and a grep of the log keep them); the options themselves are the numbered list under the plan table."""
    host = getattr(plan, "host", None) or {}
    if plan.budget_bytes is None:  # a CPU run: its RAM (hw.host_memory_gib) holds everything
        return (
            f"the plan does not fit this machine's RAM: {host['bytes'] / GIB:.1f} GiB > "
            f"{host['budget_bytes'] / GIB:.1f} GiB budget ({host['budget_source']}) — give hw.host_memory_gib "
            "the RAM the run will have, or lower train.per_device_batch_size or data.max_length"
        )
    if plan.peak_bytes <= plan.budget_bytes and not host.get("fits", True):  # the card fits; one node's RAM does not
        line = (
            f"the plan's host memory does not fit: {host['bytes'] / GIB:.1f} GiB per node > "
            f"{host['budget_bytes'] / GIB:.1f} GiB budget; "
        )
    else:
        line = f"the plan does not fit: {plan.peak_bytes / GIB:.1f} GiB > {plan.budget_bytes / GIB:.1f} GiB budget; "
    if not plan.advice:
        return line + "no option fits: lower lora.r or lora.target_modules"
    best = f"best: {plan.advice[0].split(': ', 1)[0]} ({len(plan.advice)} options listed above)"
    if len(ERROR_PREFIX + line + best) <= LOG_WIDTH:
        return line + best
    return line + f"{len(plan.advice)} option(s) that fit are listed above, best first"
