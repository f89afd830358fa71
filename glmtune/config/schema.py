"""The typed run configuration: one dataclass per Hydra config group, with each key's default and meaning.

`validate.parse_config` builds these from the composed config and validates them once; this module holds only
the schema and the names other modules share (modes, LoRA-able layers, evaluation metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

_PACKAGE = Path(__file__).resolve().parent.parent  # glmtune/
# One copy of the configs: conf/ at the top of a source checkout (beside glmtune/), mapped into glmtune/conf/ inside a
# wheel by pyproject.toml's package-dir; whichever exists is the one this install runs with.
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"


@dataclass
class ModelConfig:
    name: str = "glm4_tiny"  # preset name; the architecture facts of released models need no weights
    path: Optional[str] = None  # checkpoint folder (config.json + weights); None = built-in tiny model
    trust_remote_code: bool = False  # opt-in: run the folder's own modeling code instead of glmtune's
    quantize: str = "none"  # none | nf4 | int8: bitsandbytes base weights (QLoRA); changes numerics, so opt-in
    double_quant: bool = True  # nf4: quantize the per-block scales too (~0.37 bit/param less, ~0.4 GB on 9B)


@dataclass
class DataConfig:
    train_file: Any = "data/samples/train.jsonl"  # one file, or a list of files (mixed by data.mix; validate.py)
    val_file: Optional[str] = None
    max_length: int = 500  # tokens per example after truncation; the planner never changes a value set here
    cache_dir: Optional[str] = None  # tokenized-data cache; None = $GLMTUNE_CACHE/data (~/.cache/glmtune/data)
    num_proc: int = 0  # processes that tokenize a file on a cache miss; 0 = every core this process may use
    packing: str = "auto"  # auto | on | off: each micro-batch's examples in fewer rows (data/packing.py); auto = on a GPU when it halves them
    pack_length: Optional[int] = None  # positions per packed row; None = max(2048, longest example)
    format: str = "auto"  # auto | glm | alpaca | sharegpt | openai: how records map onto GLM messages (data/formats.py)
    mix: Optional[list[float]] = (
        None  # with several train files: each file's share of the training examples; None = all of each
    )
    val_size: float = 0.0  # hold out this fraction (< 1) or count (>= 1) of the train examples as the val set; 0 = none
    # GLM-Z1 (a chat template whose generation prompt opens <think>): the last assistant turn's reasoning is trained
    # (keep) or left out (drop: <think></think> then the answer); earlier turns follow the template
    thinking: str = "keep"


@dataclass
class LoraConfig:
    r: int = 8
    alpha: int = 32
    dropout: float = 0.1
    target_modules: list[str] = field(default_factory=lambda: ["query_key_value"])
    use_dora: bool = False  # DoRA (peft): a trained magnitude per output row; costs a weight-sized temporary per layer
    use_rslora: bool = False  # rank-stabilised scaling alpha/sqrt(r) instead of alpha/r; no memory cost


@dataclass
class DistConfig:
    strategy: str = "auto"  # auto: the plan decides; ddp: plain data parallel; zero3: DeepSpeed ZeRO-3
    nnodes: int = 1
    nproc_per_node: int = 1
    deepspeed_config: Optional[str] = None  # your DeepSpeed JSON (config/userds.py); the plan fills its "auto" values
    # Processes that share each row (Ulysses, train/sequence.py): 1 = off; N must divide the processes and the
    # query heads, and be a multiple or divisor of the KV groups. The rest of the world is data parallel.
    # auto: the planner's rung, the smallest such N that fits (plan/sequence.py); an int is used as given.
    sequence_parallel: Any = "auto"


@dataclass
class TrainConfig:
    max_steps: int = 0  # 0 = train whole epochs (num_epochs); > 0 = exactly this many optimizer steps instead
    num_epochs: float = 1.0
    learning_rate: float = 5e-4
    per_device_batch_size: int = 1  # micro-batch; global batch = this x grad_accum x world size
    grad_accum: int = 1
    eval_batch_size: int = 4
    eval_steps: int = 0  # 0 = no evaluation during training
    save_steps: int = 0  # 0 = save only at the end
    save_minutes: float = 30.0  # also checkpoint every this many minutes of training; 0 = off
    keep_checkpoints: int = 2  # complete checkpoints kept in <run dir>/checkpoints (older ones deleted)
    resume: str = "auto"  # auto | always | restart: what to do with an earlier run in the same run dir
    logging_steps: int = 5
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # fraction of the optimizer steps spent warming up; used when warmup_steps is 0
    lr_scheduler: str = "linear"  # an HF scheduler name: linear, cosine, constant_with_warmup, ...
    optimizer: str = "adamw_torch"  # adamw_torch | adamw_8bit (bitsandbytes: 2 B of state per parameter, not 8)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # + wandb, mlflow, swanlab (extras)
    weight_decay: float = 0.0
    precision: str = "auto"  # auto | bf16 | fp16 | fp32
    gradient_checkpointing: str = "auto"  # auto | on | off
    use_reentrant: bool = True  # reentrant checkpointing works with ZeRO-3 and frozen params
    seed: int = 42
    # tokens: the mean over every target token of the optimizer step (all micro-batches, all ranks), so the plan's
    # levers never change the gradient; micro_batch: each micro-batch's own mean, averaged (the official demo)
    loss_normalization: str = "tokens"
    compile: str = "auto"  # auto | on | off: torch.compile each decoder block; auto = on CUDA without ZeRO-3
    packed_attention: str = (
        "auto"  # auto | sdpa | segments | flex: attention of packed rows (models/kernels/docattention.py)
    )
    tiled_mlp: str = (
        "auto"  # auto | on | off: the MLP in token tiles (models/kernels/tiling.py); auto = when the plan needs it
    )


@dataclass
class HwConfig:
    name: str = "local"  # preset name; "local" = whatever device this process sees
    memory_gib: Optional[float] = None  # per-device budget; None = the device's own memory
    bf16: bool = True  # card supports bfloat16 (Ampere and newer)
    interconnect: str = "pcie"  # pcie | nvlink | none
    gpus_per_node: int = 1
    margin: float = 0.9  # fraction of memory_gib the plan may use; the rest absorbs estimator error
    # RAM of one node in GiB, the plan's second budget (pinned checkpoint offload, ZeRO offload, data, processes);
    # None = this machine's MemAvailable when planning for its own device, unchecked when hw.memory_gib names
    # another machine's card. Presets carry a typical node's figure.
    host_memory_gib: Optional[float] = None


@dataclass
class ProbeConfig:
    enabled: bool = True  # measure a few real steps before training and step the plan down if needed
    steps: int = 2  # optimizer steps per attempt: the second one has Adam states, the steady-state peak
    # mode=probe in one process for a larger planned world (dist.nnodes x dist.nproc_per_node): rank 0 of it on this
    # device, its collectives moving no data (probe/rehearse.py). auto: when that world is larger than the processes
    # running; true: always (one process); false: probe the processes running.
    rehearse: Any = "auto"


@dataclass
class InferConfig:
    prompts_file: Optional[str] = None  # JSONL of {"messages": [...]}, each ending on the user turn to answer
    adapter: Optional[str] = None  # a run's adapter folder; None = the base model alone
    output_file: Optional[str] = None  # None = <run dir>/predictions.jsonl
    max_new_tokens: int = 256
    batch_size: int = 0  # 0 = as many rows as the KV cache fits (the estimator's term); CPU: 8
    gpus: int = 0  # 0 = every visible GPU (CPU when there is none); N = split the model over the first N
    merge_to: Optional[str] = None  # also write base + adapter merged: the base's own files, official layout, stop ids
    prompt: Optional[str] = None  # one user message: generate for it (mode=infer) or open chat with it (mode=chat)
    system: Optional[str] = None  # system prompt put in front of infer.prompt and of every chat
    tools_file: Optional[str] = None  # JSON list of GLM-4 tools for chat (official "tools" format)
    image: Optional[str] = None  # GLM-4V: image for infer.prompt / the first chat turn
    do_sample: bool = False  # False = greedy (reproducible); True = sample with the settings below
    temperature: float = 0.8  # sampling only; < 1 sharpens the distribution
    top_p: float = 0.8  # sampling only; nucleus mass kept
    top_k: int = 0  # sampling only; 0 = no top-k cut
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages tokens already in the text
    seed: int = 42  # sampling seed: same seed, same prompts, same outputs
    overwrite: bool = False  # replace an existing output_file / merge_to; the inputs are never written
    # merge_to's layout: remote = the base's own (official names, its modeling code); hf = HF-native GlmForCausalLM
    merge_format: str = "remote"
    adapter_for: str = "none"  # peft | vllm: merge_to = the base unmerged + merge_to/adapter for that engine


@dataclass
class EvalConfig:
    generate: bool = False  # also generate a reply for each val example: ROUGE-1/2/L, BLEU-4, exact match
    max_new_tokens: int = 128  # per val example; the plan counts the KV cache of prompt + these tokens
    max_examples: int = 0  # 0 = the whole val set; N = the first N (generation costs ~N x max_new_tokens steps)
    metric_for_best: str = "eval_loss"  # picks the best checkpoint: eval_loss, eval_perplexity, eval_rouge-l, ...
    early_stopping_patience: int = 0  # 0 = off; N = stop after N evaluations without a better metric_for_best


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # interface to listen on; 127.0.0.1 exposes nothing, 0.0.0.0 every network
    port: int = 8000  # 0 = a free port the OS picks (the start line says which)
    api_key: Optional[str] = None  # then a request without `Authorization: Bearer <key>` gets 401
    model_name: Optional[str] = None  # the `model` clients ask for; None = the model folder's name (+ "-lora")
    max_batch: int = 8  # concurrent requests decoded in one generate() batch; each row holds its own KV cache
    # Who may call it (serve/guard.py, serve/port.py). A non-loopback host needs api_key or allow_unauthenticated.
    allow_unauthenticated: bool = False  # true: serve a non-loopback host without a key (a network you trust)
    allow_origins: list[str] = field(default_factory=list)  # web page origins (https://app.example) that may call it
    allow_hosts: list[str] = field(default_factory=list)  # Host names besides its address and localhost (a proxy's)
    max_body_mib: int = 16  # a request body's cap in MiB, counted as it arrives (chunked too): over it, a 413
    stop_grace_s: float = 5.0  # seconds requests in flight get to finish after Ctrl-C / SIGTERM


@dataclass
class PlanConfig:
    """mode=plan plan.emit=trainjob: the cluster objects that run this plan (glmtune/scale/trainjob.py)."""

    emit: Optional[str] = None  # null: the plan only; trainjob: trainjob.yaml + glmtune-torch.yaml in the run dir
    name: Optional[str] = None  # the TrainJob's name and its run dir's (outputs/<name>); null = <model>-lora-<6 hex>
    image: Optional[str] = None  # an image with glmtune installed; null = glmtune:<version>, a name to build or retag
    queue: Optional[str] = None  # Kueue LocalQueue (label kueue.x-k8s.io/queue-name); null = not queued by Kueue
    volume: str = "glmtune"  # ReadWriteMany PersistentVolumeClaim mounted at /glmtune: run dirs and the data cache


MODES = ("train", "plan", "probe", "infer", "chat", "serve")
# infer.merge_format / infer.adapter_for: checked with the other choices (validate.py _CHOICES)
EXPORT_CHOICES = {"infer.merge_format": ("remote", "hf"), "infer.adapter_for": ("none", "peft", "vllm")}


@dataclass
class RunConfig:
    mode: str = "train"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hw: HwConfig = field(default_factory=HwConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


# Linear layers of the GLM language models, by their official names (the estimator knows each): the ChatGLM family's
# (GLM-4-9B-chat, GLM-4V, ChatGLM3), then GLM-4-0414's HF names; on GLM-4-0414 the ChatGLM names of the lora presets
# mean the Linears that take their place (query_key_value: q_proj, k_proj, v_proj; models/glm4_0414/configuration.py).
LORA_TARGETS = (
    "query_key_value",
    "dense",
    "dense_h_to_4h",
    "dense_4h_to_h",
    "output_layer",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_up_proj",
    "down_proj",
    "lm_head",
)

GROUPS = ("model", "data", "lora", "dist", "train", "hw", "hparams_search")
# Metrics an evaluation reports (eval.generate adds the generation ones); True = higher is better.
EVAL_METRICS = {
    "eval_loss": False,
    "eval_perplexity": False,
    "eval_rouge-1": True,
    "eval_rouge-2": True,
    "eval_rouge-l": True,
    "eval_bleu-4": True,
    "eval_exact_match": True,
}
