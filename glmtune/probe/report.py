"""What the probe reports: each attempt, the report of all of them (probe.json), every rank's peaks taken as one, and
the line when no rung fits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config import RunConfig
from ..config.units import GIB
from ..plan.advice import cards_for_measured


@dataclass
class Attempt:
    choices: dict
    outcome: str  # "fits" | "over budget" | "out of memory"
    predicted_peak_bytes: int
    measured_peak_bytes: int | None  # max over ranks; None when a rank ran out of memory
    per_rank: list[int | None]
    seconds: float
    detail: dict = field(default_factory=dict)  # CUDA: peak allocated/active, allocation retries


@dataclass
class ProbeReport:
    device: str
    emulated: bool
    method: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    per_rank: list[int | None]
    attempts: list[Attempt]
    final: dict
    fits: bool
    seconds: float
    rehearsed: int = 0  # ranks of the world rehearsed on this one device (probe/rehearse.py); 0 = a real probe
    rehearsal: dict = field(default_factory=dict)  # what a rehearsal adds and what it cannot see

    def to_dict(self) -> dict:
        return asdict(self)


def over_in_evaluation(peaks: dict | None, detail: dict, budget: int | None) -> bool:
    """Whether evaluation is the phase over budget: it ran out of memory in an evaluation, or the training
    steps before the first evaluation fit and an evaluation did not."""
    if peaks is None:
        return detail.get("phase") == "eval"
    first = detail.get("first_training_peak_bytes")
    return budget is not None and "eval" in peaks and peaks["eval"] > budget and first is not None and first <= budget


def merge_ranks(per_rank: list[tuple[dict | None, dict]]) -> tuple[dict | None, dict]:
    """Every rank's (phase peaks, detail) as one: the largest peak of each phase; out of memory when any rank
    was, in the phase that rank ran out in."""
    oom = [d for p, d in per_rank if p is None]
    if oom:
        return None, {**per_rank[0][1], **oom[0]}
    peaks = {k: max(p.get(k, 0) for p, _ in per_rank) for k in per_rank[0][0]}
    firsts = [d.get("first_training_peak_bytes") for _, d in per_rank]
    detail = {
        **per_rank[0][1],
        "phase_peak_bytes": peaks,
        "first_training_peak_bytes": max(firsts) if None not in firsts else None,
    }
    return peaks, detail


def probe_shortfall(report: ProbeReport, run: RunConfig) -> str:
    """The exit-3 line when no rung fit: what was measured against which budget, and the presets whose budget
    holds the smallest measured peak (measured, not re-planned: the estimate was already shown too low)."""
    measured = [a.measured_peak_bytes for a in report.attempts if a.measured_peak_bytes]
    seen = f"measured {min(measured) / GIB:.2f} GiB at best" if measured else "every rung ran out of memory"
    fits = cards_for_measured(run, min(measured)) if measured else []
    return f"the probe found no rung that fits: {seen}, budget {report.budget_bytes / GIB:.2f} GiB" + (
        f"; what fits: {'; '.join(fits)}" if fits else "; no preset holds it: shorten data.max_length"
    )
