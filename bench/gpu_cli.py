"""The user's commands on a GPU, as a user types them (issue 33): `python bench/gpu_pending.py --part cli`.

Each row is one `python -m glmtune ...` in its own process with its own time limit, on random-weight checkpoints
of the released architectures (memory and speed do not depend on the values) with glmtune's tiny tokenizer
files beside them (the probe's worst-case rows are token ids). A checkpoint is written just before its model's
rows and deleted after them, so the three fit a 64 GB disk. `--tiny` runs the same rows on CPU with the tiny
models, so the driver itself is tested without a GPU.

Per row: the exit code, the plan's choices, the probe's predicted / measured peak (the last rung), the run's own
peak per phase (metrics.json: measured as the probe measures), run / probe and estimate / probe, tokens/s.
A row passes when it exits 0 (or 3: refused before step 1 with advice), its run's peak is at most 1 % over its
probe's, and the estimate is at most 1 % under the probe's measurement (GPU only: on CPU the estimate's
allocator terms are not modelled, so that column is shown but not judged).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TOTAL_S = 470  # the whole part, inside one 10-minute device call (with the install and bench/ckpt_early_stop.py)
GIB = 2**30


def long_conversations(path: Path, count: int, words: int) -> Path:
    """`count` conversations of a 20-word prompt and a `words`-word answer (~3.7 tiny-tokenizer tokens a word:
    6,700 words are ~24,700 tokens, the issue's "long data")."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": " ".join(f"w{(i * 7919 + j) % 997}" for j in range(20))},
                {"role": "assistant", "content": " ".join(f"a{(i + j) % 991}" for j in range(words))},
            ]
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def checkpoint(preset: str, family: str, work: Path, tiny: bool, timeout: int = 180) -> Path:
    if tiny:
        from glmtune.models.presets import ensure_tiny

        return ensure_tiny(family)
    folder = work / f"ckpt-{preset}"
    code = (
        "import sys, torch; from pathlib import Path; sys.path.insert(0, {bench!r}); from quantized import "
        "write_checkpoint; from glmtune.models import released_config; "
        "from gpu_cli import fix_image_ids, write_tokenizer; folder = Path({folder!r}); "
        "write_checkpoint(released_config({preset!r}), folder, 'cuda:0', torch.bfloat16); "
        "write_tokenizer(folder, {family!r}); fix_image_ids(folder)"
    )
    subprocess.run(
        [sys.executable, "-c", code.format(bench=str(BENCH), folder=str(folder), preset=preset, family=family)],
        check=True,
        timeout=timeout,
        cwd=REPO,
    )
    return folder


def write_tokenizer(folder: Path, family: str) -> None:
    """The tiny tokenizer of `family` beside the random weights: GLM-4-0414's as tokenizer.json with its template."""
    if family == "glm4_0414":
        from glmtune.models.glm4_0414.tiny import CHAT_TEMPLATE
        from glmtune.models.tokenizer_files import write_tiny_fast_tokenizer

        write_tiny_fast_tokenizer(folder, CHAT_TEMPLATE)
    else:
        from glmtune.models.tokenizer_files import write_tiny_tokenizer

        write_tiny_tokenizer(folder, family)


def fix_image_ids(folder: Path) -> None:
    """GLM-4V's config.json names its image markers by id (151339/151340 in the released vocabulary); beside the
    tiny tokenizer they must be that tokenizer's ids, as in glmtune's own tiny GLM-4V checkpoint."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("vision_config"):
        from glmtune.models import load_tokenizer

        tok = load_tokenizer(folder)
        config.update(
            boi_token_id=tok.get_command("<|begin_of_image|>"), eoi_token_id=tok.get_command("<|end_of_image|>")
        )
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def rows(tiny: bool, work: Path) -> list[tuple[str, str, str, list[str], int]]:
    """(title, model preset, tokenizer family, extra arguments, time limit in s) in the order they run."""
    if tiny:
        long = long_conversations(work / "long.jsonl", 4, 200)
        length, long_len, card, small = "256", "512", [], []
    else:
        long = long_conversations(work / "long.jsonl", 16, 6700)
        length, long_len, card, small = "8192", "32768", ["+hw=a100_40g"], ["+hw=rtx4090_24g"]
    glm4, glm4v, glm3 = (
        ("glm4_tiny", "glm4v_tiny", "chatglm3_tiny") if tiny else ("glm4_9b_chat", "glm4v_9b", "chatglm3_6b")
    )
    steps = ["train.max_steps=2"] if tiny else ["train.max_steps=6"]
    return [
        ("design card: shipped samples with val", glm4, "glm4", [*card, *steps], 100),
        (
            "8K long data, no val",
            glm4,
            "glm4",
            [*small, f"data.train_file={long}", "data.val_file=null", f"data.max_length={length}", *steps],
            80,
        ),
        (
            "4K long data, eval every 2 steps",
            glm4,
            "glm4",
            [
                *small,
                f"data.train_file={long}",
                f"data.val_file={long}",
                f"data.max_length={int(length) // 2}",
                "train.eval_steps=2",
                *(["train.max_steps=2"] if tiny else ["train.max_steps=4"]),
            ],
            90,
        ),
        (
            "mode=probe 32K with eval",
            glm4,
            "glm4",
            ["mode=probe", *card, f"data.train_file={long}", f"data.val_file={long}", f"data.max_length={long_len}"],
            80,
        ),
        ("GLM-4V vision samples", glm4v, "glm4v", ["data=samples_vision", *card, *steps], 110),
        ("ChatGLM3 shipped samples", glm3, "chatglm3", [*small, *steps], 70),
    ]


def row_result(run_dir: Path) -> dict:
    out = {}
    probe, metrics, plan = run_dir / "probe.json", run_dir / "metrics.json", run_dir / "plan.json"
    if probe.is_file():
        p = json.loads(probe.read_text())
        out.update(
            predicted=p["predicted_peak_bytes"],
            probed=p["measured_peak_bytes"],
            rungs=len(p["attempts"]),
            probe_phases=p["attempts"][-1]["detail"].get("phase_peak_bytes"),
            final=p["final"],
        )
    if metrics.is_file():
        m = json.loads(metrics.read_text())
        out.update(phases=m.get("phase_peak_bytes"), tokens_per_s=m.get("tokens_per_s"))
    if plan.is_file() and "final" not in out:
        out["final"] = json.loads(plan.read_text()).get("choices")
    return out


def _choices(c: dict | None) -> str:
    if not c:
        return "-"
    return (
        f"mb {c['micro_batch_size']}x{c['grad_accum']}, eval {c.get('eval_batch_size', '-')}, "
        f"ckpt {'on' if c['gradient_checkpointing'] else 'off'}, chunk {c['loss_chunk_tokens']}"
        + (", offload ckpt" if c.get("offload_checkpoints") else "")
        + (", ZeRO-3" if c["zero_stage"] == 3 else "")
    )


def judge(rc, r: dict, on_gpu: bool) -> tuple[str, bool]:
    if rc == 3:
        return "refused before step 1 (exit 3)", True
    if rc != 0:
        return f"exit {rc}", False
    problems = []
    if r.get("phases") and r.get("probed") and max(r["phases"].values()) > r["probed"] * 1.01:
        problems.append("run > probe + 1 %")
    if on_gpu and r.get("probed") and r["predicted"] < r["probed"] * 0.99:
        problems.append("estimate > 1 % under probe")
    return ("; ".join(problems) or "ok"), not problems


def run_cli(tiny: bool, work: Path, header: str) -> int:
    import torch

    on_gpu = torch.cuda.is_available()
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    t0, table, failures, ckpts, logs = time.perf_counter(), [], 0, {}, []
    plan = rows(tiny, work)
    only = os.environ.get("GLMTUNE_CLI_ROWS")  # e.g. "5,6": rerun some rows (1-based)
    plan = [r for i, r in enumerate(plan, 1) if not only or str(i) in only.split(",")]
    for i, (title, preset, family, extra, limit) in enumerate(plan):
        left = TOTAL_S - (time.perf_counter() - t0)
        if preset not in ckpts:
            for old in list(ckpts):  # one full-size checkpoint on disk at a time
                if not tiny:
                    shutil.rmtree(ckpts.pop(old), ignore_errors=True)
            start = time.perf_counter()
            ckpts[preset] = checkpoint(preset, family, work, tiny)
            print(f"checkpoint {preset}: {time.perf_counter() - start:.0f} s", flush=True)
            left = TOTAL_S - (time.perf_counter() - t0)
        run_dir = work / f"row{i + 1}"
        shutil.rmtree(run_dir, ignore_errors=True)
        command = [
            sys.executable,
            "-m",
            "glmtune",
            f"model={preset}",
            f"model.path={ckpts[preset]}",
            *extra,
            "train.logging_steps=1",
            "train.save_minutes=0",
            f"hydra.run.dir={run_dir}",
        ]
        if left < 30:
            table.append(f"| {title} | skipped: the part's {TOTAL_S} s are spent | | | | | | |")
            failures += 1
            continue
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=min(limit, left))
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        seconds = time.perf_counter() - start
        r = row_result(run_dir)
        verdict, ok = judge(rc, r, on_gpu)
        failures += not ok
        gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"  # noqa: E731
        probe = f"{gib(r.get('predicted'))} / {gib(r.get('probed'))}" + (
            f" ({r['rungs']} rungs)" if r.get("rungs", 1) > 1 else ""
        )
        est = f"{r['predicted'] / r['probed'] - 1:+.1%}" if r.get("probed") else "-"
        phases = ", ".join(f"{k} {v / GIB:.2f}" for k, v in (r.get("phases") or {}).items()) or "-"
        ratio = f"{max(r['phases'].values()) / r['probed']:.3f}" if r.get("phases") and r.get("probed") else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        table.append(
            f"| {title} | {rc} | {_choices(r.get('final'))} | {probe} | {est} | {phases} | {ratio} | {tps} | "
            f"{seconds:.0f} | {verdict} |"
        )
        print(table[-1], flush=True)
        if not ok:
            logs += [
                f"### row {i + 1} ({title}): `{' '.join(c if not c.startswith('/') else Path(c).name for c in command)}`",
                *["    " + line for line in out.strip().splitlines()[-25:]],
            ]
    if not tiny:
        for folder in ckpts.values():
            shutil.rmtree(folder, ignore_errors=True)
    print(f"\n## gpu_pending --part cli{' (tiny, CPU)' if tiny else ''}: {header}; {time.perf_counter() - t0:.0f} s")
    print(
        "| command | exit | final choices | probe predicted / measured GiB | estimate vs probe | run peak per phase GiB "
        "| run / probe | tokens/s | s | verdict |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(table))
    if logs:
        print("\n".join(logs))
    return 1 if failures else 0
