"""One rank of tests/plan/test_longctx.py's measurement, under `torchrun --nproc_per_node 2` on gloo (CPU): the live
tensor bytes of one steady-state LoRA step on this rank's half of every row (probe/track.measure_lora_step), for
each shape in the JSON file argv[1]; rank 0 writes {name: peak bytes} to argv[2]."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from glmtune.models import GLMConfig
from glmtune.models.kernels.ulysses import SequenceGroup
from glmtune.plan.estimate import RunShape
from glmtune.probe.track import measure_lora_step


def main(cases_file: str, out_file: str) -> None:
    dist.init_process_group("gloo")
    sp = SequenceGroup.of(None)
    cases = json.load(open(cases_file))
    out = {}
    for name, case in cases.items():
        shape = RunShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in case["shape"].items()})
        peak, _ = measure_lora_step(GLMConfig(**case["arch"]), shape, sequence=sp)
        out[name] = peak
    if dist.get_rank() == 0:
        json.dump(out, open(out_file, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
