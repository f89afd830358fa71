"""One GPU session's rows in priority order under a deadline, resumable on the same (warm) machine.

    python bench/gpu_session.py --deadline-s 540 --out $OUT      # first call: as many rows as fit
    python bench/gpu_session.py --deadline-s 180 --out $OUT      # a second call on the warm machine: the rest
    python bench/gpu_session.py --tiny --deadline-s 600          # CPU, tiny models: the driver itself

A task gets 15 minutes of device time in all, and the parts of bench/gpu_pending.py together need ~25. This runs
their rows one by one, most valuable first (the new code paths before the regression rows they share code with),
each in its own process with min(its limit, time left); a row that cannot start with 30 s left is left for the
next call. What each row did is kept in WORK/done.json, so a second call on the same machine goes on where the first
stopped, and checkpoints already written are reused (a 9B checkpoint costs ~20 s to write; the disk holds two).
Each row's output and its table lines go to OUT/session.md as they finish, so a call killed at its limit still
returns what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_cli import judge, long_conversations, row_result
from gpu_pending import header
from gpu_rehearse import QLORA, REHEARSALS, TINY_REHEARSALS, WORDS_PER_TOKEN, _run, phase_rows

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GIB = 2**30


def checkpoint(preset: str, family: str, work: Path, tiny: bool) -> Path:
    """A random-weight checkpoint of `preset`, written once per machine (its `.complete` file says it is whole);
    at most two full-size ones on the 64 GiB disk: the oldest others are removed first."""
    if tiny:
        from glmtune.models.presets import ensure_tiny

        return ensure_tiny(family)
    folder = work / f"ckpt-{preset}"
    if (folder / ".complete").is_file():
        return folder
    for old in sorted(work.glob("ckpt-*"), key=lambda p: p.stat().st_mtime)[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    code = (
        "import sys, torch; from pathlib import Path; sys.path.insert(0, {bench!r}); from quantized import "
        "write_checkpoint; from glmtune.models import released_config; from gpu_cli import fix_image_ids, "
        "write_tokenizer; folder = Path({folder!r}); write_checkpoint(released_config({preset!r}), folder, "
        "'cuda:0', torch.bfloat16); write_tokenizer(folder, {family!r}); fix_image_ids(folder)"
    )
    subprocess.run(
        [sys.executable, "-c", code.format(bench=str(BENCH), folder=str(folder), preset=preset, family=family)],
        check=True,
        timeout=240,
        cwd=REPO,
    )
    (folder / ".complete").write_text("")
    return folder


def rows(tiny: bool, work: Path) -> list[dict]:
    """Every row, most valuable first. kind: probe (a probe.json's phases), cli (gpu_cli's row), script."""
    glm4, glm4v, glm0414 = (
        ("glm4_tiny", "glm4v_tiny", "glm4_0414_tiny") if tiny else ("glm4_9b_chat", "glm4v_9b", "glm4_9b_0414")
    )
    out = []
    for i, (title, layout, gpus, tokens, steps, limit) in enumerate(TINY_REHEARSALS if tiny else REHEARSALS[:3], 1):
        out.append(
            dict(
                name=f"rehearse-{i}",
                title=f"rehearsal: {title}",
                kind="probe",
                ckpt=("glm4_9b_chat", "glm4"),
                preset=glm4,
                limit=limit,
                args=[*layout, f"dist.nproc_per_node={gpus}", f"data.max_length={tokens}", f"probe.steps={steps}"],
                data=(2, int(tokens * WORDS_PER_TOKEN) + 50),
            )
        )
    card, small = ([], []) if tiny else (["+hw=a100_40g"], ["+hw=rtx4090_24g"])
    steps = ["train.max_steps=2" if tiny else "train.max_steps=6"]
    out.append(
        dict(
            name="cli-1",
            title="regression: the design card (--part cli row 1)",
            kind="cli",
            ckpt=("glm4_9b_chat", "glm4"),
            preset=glm4,
            limit=120,
            args=[*card, *steps],
        )
    )
    for preset, family, quant, tokens in QLORA[:2]:
        out.append(
            dict(
                name=f"qlora-{preset}-{quant}",
                title=f"QLoRA {quant}: {preset} at {tokens} on a 24 GB cap",
                kind="probe",
                ckpt=(preset, family),
                preset=glm4,
                limit=100,
                args=[*small, f"model.quantize={quant}", f"data.max_length={256 if tiny else tokens}"],
                data=(2, 2400),
            )
        )
    docattn = (
        ["--lengths", "256,512", "--docs", "128", "--steps", "1"]
        if tiny
        else [
            "--model",
            "glm4_9b",
            "--layers",
            "2",
            "--lengths",
            "2048,4096,8192,16384,32768",
            "--docs",
            "512,2048",
            "--steps",
            "2",
        ]
    )
    out.append(
        dict(
            name="docattn",
            title="per-document attention vs the dense mask",
            kind="script",
            limit=140,
            command=[sys.executable, str(BENCH / "doc_attention.py"), *docattn],
        )
    )
    if not tiny:
        out.append(
            dict(
                name="0414-memory",
                title="GLM-4-0414 memory: 9B 8K, 32B bf16 2K, 32B nf4 under 24 GB",
                kind="script",
                limit=150,
                command=[
                    sys.executable,
                    str(BENCH / "gpu_memory.py"),
                    "--grid",
                    "0414",
                    "--out",
                    str(work / "0414.jsonl"),
                    "--budget-s",
                    "130",
                ],
            )
        )
    out.append(
        dict(
            name="0414-cli",
            title="9B-0414: probe + 3 steps at 8K, 40 GB card",
            kind="cli",
            ckpt=("glm4_9b_0414", "glm4_0414"),
            preset=glm0414,
            limit=110,
            args=[*card, "data.val_file=null", f"data.max_length={256 if tiny else 8192}", "train.max_steps=3"],
            data=(8, 300 if tiny else 6000),
        )
    )
    out.append(
        dict(
            name="cli-5",
            title="regression: GLM-4V vision samples (--part cli row 5)",
            kind="cli",
            ckpt=("glm4v_9b", "glm4v"),
            preset=glm4v,
            limit=110,
            args=["data=samples_vision", *card, *steps],
        )
    )
    out.append(
        dict(
            name="qlora-glm4v",
            title="QLoRA nf4: glm4v_9b at 2048 on a 24 GB cap",
            kind="probe",
            ckpt=("glm4v_9b", "glm4v"),
            preset=glm4v,
            limit=100,
            args=[*small, "model.quantize=nf4", f"data.max_length={256 if tiny else 2048}"],
            data=(2, 2400),
        )
    )
    return out


def command(row: dict, tiny: bool, work: Path) -> list[str]:
    if row["kind"] == "script":
        return row["command"]
    ckpt = checkpoint(*row["ckpt"], work, tiny)
    args = list(row["args"])
    if "data" in row:
        count, words = row["data"]
        data = long_conversations(work / f"{row['name']}.jsonl", count, words)
        args.append(f"data.train_file={data}")
    run_dir = work / row["name"]
    shutil.rmtree(run_dir, ignore_errors=True)
    if row["kind"] == "probe":
        return _run(row["preset"], ckpt, run_dir, *args)
    return [
        sys.executable,
        "-m",
        "glmtune",
        f"model={row['preset']}",
        f"model.path={ckpt}",
        *args,
        "train.logging_steps=1",
        "train.save_minutes=0",
        "train.report_to=[]",
        f"hydra.run.dir={run_dir}",
    ]


def table(row: dict, rc, out: str, work: Path, on_gpu: bool) -> list[str]:
    if row["kind"] == "probe":
        return phase_rows([work / row["name"]])
    if row["kind"] == "cli":
        r = row_result(work / row["name"])
        verdict, _ = judge(rc, r, on_gpu)
        gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"  # noqa: E731
        phases = ", ".join(f"{k} {v / GIB:.2f}" for k, v in (r.get("phases") or {}).items()) or "-"
        return [
            f"probe predicted / measured {gib(r.get('predicted'))} / {gib(r.get('probed'))} GiB; run peak per "
            f"phase {phases}; tokens/s {r.get('tokens_per_s') or '-'}; final {r.get('final')}; {verdict}"
        ]
    return [line for line in out.splitlines() if line.startswith(("|", "suggested", "done in"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline-s", type=float, required=True, help="stop starting rows after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny models")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None, help="folder for session.md (default: WORK)")
    args = ap.parse_args()
    import torch

    t0, on_gpu = time.perf_counter(), torch.cuda.is_available()
    work = Path(args.work or f"/tmp/glmtune-session{'-tiny' if args.tiny else ''}")
    work.mkdir(parents=True, exist_ok=True)
    report = Path(args.out or work) / "session.md"
    done_file = work / "done.json"
    done = json.loads(done_file.read_text()) if done_file.is_file() else {}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    with report.open("a") as log:
        log.write(f"\n## gpu_session{' (tiny, CPU)' if args.tiny else ''}: {header()}\n")
        for row in rows(args.tiny, work):
            if row["name"] in done:
                continue
            left = args.deadline_s - (time.perf_counter() - t0)
            if left < 30:
                log.write(f"### {row['name']}: left for the next call ({left:.0f} s left)\n")
                continue
            start = time.perf_counter()
            try:
                cmd = command(row, args.tiny, work)
                proc = subprocess.run(
                    cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=min(row["limit"], left)
                )
                rc, out = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc, out = "timeout", exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
            except subprocess.SubprocessError as exc:  # a checkpoint that could not be written
                rc, out = "checkpoint", str(exc)
            seconds = time.perf_counter() - start
            lines = table(row, rc, out, work, on_gpu)
            log.write(f"### {row['name']}: {row['title']} ({seconds:.0f} s, exit {rc})\n" + "\n".join(lines) + "\n")
            if rc != 0:
                log.write("\n".join("    " + line for line in out.strip().splitlines()[-20:]) + "\n")
                rank_log = work / row["name"] / "rank0.log"  # the traceback or the OOM's allocation and phase
                if rank_log.is_file():
                    tail = [
                        line
                        for line in rank_log.read_text(errors="replace").splitlines()
                        if "Error" in line or "Tried to allocate" in line or "phase" in line
                    ][-12:]
                    log.write("\n".join("    rank0.log: " + line[:300] for line in tail) + "\n")
            log.flush()
            done[row["name"]] = {"rc": rc, "seconds": round(seconds, 1)}
            done_file.write_text(json.dumps(done, indent=1))
            print(f"{row['name']}: exit {rc}, {seconds:.0f} s", flush=True)
    print(report.read_text())


if __name__ == "__main__":
    main()
