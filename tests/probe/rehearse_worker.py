"""The probe of each case of tests/probe/test_rehearse.py, the way mode=probe runs it (glmtune/modes: prepare, planned,
probe_stage), either as one rank of a real launch (`torchrun --nproc_per_node N rehearse_worker.py CASES OUT`, gloo)
or as one process rehearsing every case's world in turn (`python rehearse_worker.py CASES OUT`: probe.rehearse=auto
with dist.nproc_per_node=N). CASES: {name: [overrides]}; rank 0 writes {name: probe.json} to OUT."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir

from glmtune.config import CONF_DIR
from glmtune.modes.prepare import prepare
from glmtune.modes.run import planned, probe_stage


def probe(overrides: list[str], run_dir: Path) -> dict | None:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["mode=probe", *overrides])
    prep = prepare(cfg, overrides)
    plan, start = planned(prep, run_dir, plan_scratch=True)
    probe_stage(prep, plan, start, run_dir)
    report = run_dir / "probe.json"  # rank 0's (modes/report.report_probe)
    return json.loads(report.read_text()) if report.is_file() else None


def main(cases_file: str, out_file: str) -> None:
    cases = json.loads(Path(cases_file).read_text())
    out, env = {}, dict(os.environ)
    for name, overrides in cases.items():
        # The same folder on every rank of a launch (rank 0 writes probe.json into it); left for the test's tmp dir.
        run_dir = Path(out_file).parent / "runs" / f"{'real' if 'RANK' in os.environ else 'rehearsed'}-{name}"
        run_dir.mkdir(parents=True, exist_ok=True)
        out[name] = probe(overrides, run_dir)
        fresh_process(env)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out_file).write_text(json.dumps(out))


def fresh_process(env: dict[str, str]) -> None:
    """Each case as in a process of its own (mode=probe is one probe per process, and its ladder only ever adds
    ZeRO-3). A ZeRO-3 case leaves ACCELERATE_USE_DEEPSPEED=true (transformers' TrainingArguments) and accelerate's
    DeepSpeed state, which would run the next case's Trainer under DeepSpeed ZeRO-2, and DeepSpeed's own
    torch.nn.functional.linear ("this will persist unless manually reset"), which keeps other tensors."""
    os.environ.clear()
    os.environ.update(env)
    AcceleratorState._reset_state()
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if zero is not None and hasattr(zero.InsertPostInitMethodToModuleSubClasses, "linear_bk"):
        torch.nn.functional.linear = zero.InsertPostInitMethodToModuleSubClasses.linear_bk


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
