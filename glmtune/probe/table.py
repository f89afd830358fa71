"""The probe's table on the console: each attempt's levers, predicted and measured peaks, phases and outcome."""

from __future__ import annotations

import textwrap

from ..config.units import GIB
from ..train.phases import format_peaks
from .report import ProbeReport


def format_probe(report: ProbeReport):
    from rich.table import Table

    def gib(x):
        return "-" if x is None else f"{x / GIB:.3f}"

    budget = "none" if report.budget_bytes is None else f"{report.budget_bytes / GIB:.3f} GiB"
    rss = [r for r in (report.attempts[-1].detail.get("host_rss_per_rank") or [] if report.attempts else []) if r]
    host = (
        f", host RSS {sum(rss) / GIB:.2f} GiB" + (" of rank 0" if report.rehearsed else f" over {len(rss)} rank(s)")
        if rss
        else ""
    )
    where = f"{report.device}{' (emulated card)' if report.emulated else ''}"
    if report.rehearsed:
        where += f", rehearsed: {report.rehearsed} ranks on 1 device"
    title = f"probe on {where}: budget {budget}, {report.seconds:.1f} s{host}"
    caption = None
    if report.rehearsed:  # what the measured GiB hold beyond rank 0's own tensors, and what no rehearsal sees
        added = report.rehearsal.get("added_terms") or {}
        caption = (
            f"measured: rank 0 of {report.rehearsed}"
            + "".join(f" + {name} {value / GIB:.2f} GiB" for name, value in added.items())
            + f"; {report.rehearsal['unseen']}"
        )
        # The console soft-wraps (rundir/files.py): wrapped here, the caption keeps a log's 120 columns too.
        caption = textwrap.fill(caption, 120, break_long_words=False)
    # Nine columns, the levers in one: the table keeps its words whole in a 120-column log (rundir/files.py).
    table = Table(title=title, caption=caption)
    for col in (
        "attempt",
        "batch",
        "memory levers on",
        "predicted GiB",
        "measured GiB",
        "error",
        "phases: measured GiB",
        "tensors: predicted / allocated GiB",
        "outcome",
    ):
        table.add_column(col)
    for i, a in enumerate(report.attempts, 1):
        c = a.choices
        err = "-" if a.measured_peak_bytes is None else f"{(a.predicted_peak_bytes / a.measured_peak_bytes - 1):+.1%}"
        tensors = (
            f"{gib(a.detail['predicted_tensor_bytes'])} / {gib(a.detail['peak_allocated_bytes'])}"
            if "peak_allocated_bytes" in a.detail
            else "-"
        )
        phases = (
            format_peaks(a.detail["phase_peak_bytes"]).removesuffix(" GiB")
            if a.detail.get("phase_peak_bytes")
            else f"out of memory in {a.detail.get('phase', 'train')}"
            if a.measured_peak_bytes is None
            else "-"
        )
        outcome = a.outcome + (f"; next: {a.detail['next_rung']}" if a.detail.get("next_rung") else "")
        levers = [
            name
            for name, on in (
                ("checkpointing", c["gradient_checkpointing"]),
                (f"loss chunk {c['loss_chunk_tokens']}", c["loss_chunk_tokens"]),
                ("checkpoints in CPU memory", c.get("offload_checkpoints", False)),
                (f"MLP tiles {c.get('mlp_tile_tokens', 0)}", c.get("mlp_tile_tokens", 0)),
                ("ZeRO-3", c["zero_stage"] == 3),
                ("parameter offload", c["offload_params"]),
                (f"SP {c.get('sequence_parallel', 1)}", c.get("sequence_parallel", 1) > 1),
            )
            if on
        ]
        table.add_row(
            str(i),
            f"{c['micro_batch_size']} x {c['grad_accum']}, eval {c['eval_batch_size']}",
            ", ".join(levers) or "none",
            gib(a.predicted_peak_bytes),
            gib(a.measured_peak_bytes),
            err,
            phases,
            tensors,
            outcome,
        )
    return table
