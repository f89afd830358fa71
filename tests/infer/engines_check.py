"""Run by tests/infer/test_engines.py with the engines venv's Python (vLLM CPU build, transformers 5.x, PEFT), nothing of
glmtune importable: load glmtune's exports as a user's engine does and write what the engine computed as JSON.

    python engines_check.py JOB.json RESULT.json

JOB: {"vllm": [{"name", "model", "lora" (folder or null), "max_lora_rank", "conversations", "max_tokens",
                "requests": [{"name", "lora", "chat_template" (file or null), "conversations", "max_tokens"}]}],
      "transformers": [{"name", "model", "adapter" (folder or null), "conversations", "ids"}]}
Every vLLM engine of the job runs in this one process, one after the other, its engine core in-process (a start
costs ~2 s on 2 cores; ~17 s with the core in a process of its own, vLLM's default, which test_engines.py's
`vllm serve` test keeps), with greedy decoding, fp32 and a 1 GiB KV cache; prompts are rendered by the engine
from the export's chat template (or a request's `chat_template` file, as `vllm serve --chat-template` does). A
spec's `requests` run on its engine after its own conversations, each with its own LoRA: more adapters of one
base for the price of one engine start.
The result names the model class vLLM chose for each engine (its native one, or the Transformers backend).
"""

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny models need a few MiB
# The engine core in this process: the numbers are the same, and each engine start no longer spawns a process
# that imports vLLM and torch again (7 engines: 123 s -> 19 s on 2 cores). `vllm serve` keeps the default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run_vllm(spec: dict) -> dict:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        enable_lora=bool(spec.get("lora")),
        max_lora_rank=spec.get("max_lora_rank") or 16,
    )
    model_class = repr(llm).split("(", 1)[0]  # the module tree vLLM built: its native class or the Transformers backend
    rows = _chat(llm, spec, LoRARequest("adapter", 1, spec["lora"]) if spec.get("lora") else None)
    requests = {}
    for number, request in enumerate(spec.get("requests", []), 2):
        template = open(request["chat_template"], encoding="utf-8").read() if request.get("chat_template") else None
        requests[request["name"]] = _chat(llm, request, LoRARequest(request["name"], number, request["lora"]), template)
    seconds = time.monotonic() - started
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"rows": rows, "requests": requests, "model_class": model_class, "seconds": round(seconds, 1)}


def _chat(llm, spec: dict, lora, chat_template: str | None = None) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], logprobs=1, prompt_logprobs=1)
    outputs = llm.chat(spec["conversations"], params, lora_request=lora, chat_template=chat_template, use_tqdm=False)
    rows = []
    for out in outputs:
        gen = out.outputs[0]
        rows.append(
            {
                "prompt_ids": list(out.prompt_token_ids),
                "ids": list(gen.token_ids),
                "text": gen.text,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
                # logprob of each prompt token given the ones before it (the first has none)
                "prompt_logprobs": [
                    None if lp is None else lp[t].logprob for t, lp in zip(out.prompt_token_ids, out.prompt_logprobs)
                ],
                "logprobs": [lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs)],
            }
        )
    return rows


def run_transformers(spec: dict) -> dict:
    """AutoTokenizer / AutoModelForCausalLM (no trust_remote_code), PEFT on top when an adapter is given: the chat
    template's prompt ids and the fp32 logits of given ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    prompt_ids = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for c in spec["conversations"]
    ]
    if not spec.get("ids"):  # the tokenizer alone
        return {"prompt_ids": prompt_ids, "tokenizer": type(tokenizer).__name__}
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    if spec.get("adapter"):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, spec["adapter"])
    model.eval()
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([ids])).logits[0].tolist() for ids in spec["ids"]]
    return {
        "prompt_ids": prompt_ids,
        "logits": logits,
        "tokenizer": type(tokenizer).__name__,
        "model": type(model.get_base_model() if spec.get("adapter") else model).__name__,
    }


def main() -> None:
    job = json.load(open(sys.argv[1]))
    result = {"transformers": {s["name"]: run_transformers(s) for s in job.get("transformers", [])}}
    result["vllm"] = {s["name"]: run_vllm(s) for s in job.get("vllm", [])}
    import peft
    import transformers
    import vllm

    result["versions"] = {"vllm": vllm.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this file again
    main()
