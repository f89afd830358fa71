"""Issue 25: a run imports bitsandbytes, DeepSpeed, optuna and submitit only when it uses them (bitsandbytes
alone cost ~2 s per launch). The CLI runs in a fresh interpreter; its sys.modules is read after it ends."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("bitsandbytes", "deepspeed", "optuna", "submitit")

_RUN = """
import json, runpy, sys
heavy = set(json.loads(sys.argv[2]))
sys.argv = ["glmtune", *json.loads(sys.argv[1])]
try:
    runpy.run_module("glmtune", run_name="__main__")
except SystemExit as stop:
    code = stop.code
else:
    code = 0
print("HEAVY=" + json.dumps([code, sorted({m.split(".")[0] for m in sys.modules} & heavy)]))
"""


def _heavy_modules(args: list[str], cwd) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps(args), json.dumps(HEAVY)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("HEAVY=")), None)
    assert line is not None, proc.stderr[-3000:]
    return tuple(json.loads(line[len("HEAVY="):]))


def test_probe_without_quantization_imports_no_optional_stack(tmp_path, repo):
    code, heavy = _heavy_modules(["mode=probe", f"hydra.run.dir={tmp_path / 'run'}",
                                  f"data.cache_dir={tmp_path / 'cache'}",
                                  f"data.train_file={repo / 'data/samples/train.jsonl'}", "data.val_file=null"],
                                 tmp_path)
    assert code == 0 and heavy == []


def test_plan_imports_no_optional_stack(tmp_path):
    assert _heavy_modules(["mode=plan", "model=glm4_9b_chat", "+hw=a100_40g"], tmp_path) == (0, [])
