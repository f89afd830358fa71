"""A run imports bitsandbytes, DeepSpeed, optuna and submitit only when it uses them (bitsandbytes alone cost ~2 s
per launch), and `mode=plan` imports planning only: no torch._dynamo, no model code, no tokenizer (~1 s of a
~3.5 s plan was torch._dynamo, pulled in by the planner reading a constant beside the attention code;
bench/plan_import.py). The CLI runs in a fresh interpreter; its sys.modules is read after it ends."""

from __future__ import annotations

from helpers.cli import glmtune_inspected

HEAVY = ("bitsandbytes", "deepspeed", "optuna", "submitit")
# What mode=plan must leave unloaded besides HEAVY, as module-name prefixes: the compiler stack, transformers' model
# and tokenizer code, the tokenizer libraries, PEFT/accelerate.
NOT_FOR_PLAN = (
    "torch._dynamo",
    "torch._inductor",
    "transformers.modeling_utils",
    "transformers.tokenization_utils",
    "transformers.tokenization_utils_base",
    "transformers.models",
    "tiktoken",
    "sentencepiece",
    "tokenizers",
    "peft",
    "accelerate",
)
# glmtune's own model code, by a module's last name so that a move between folders of glmtune/models keeps it
# covered: the decoder and its layers, attention kernels, the vision tower, generation, quantization, tokenizers.
# Read by plan: the architecture (configuration, presets, loading's file checks), the chat template's token
# counts, the attention-path rule (attnpath) and the sequence group's head check (ulysses).
MODEL_CODE = (
    "modeling",
    "layers",
    "attention",
    "docattention",
    "causal_lm",
    "masks",
    "tiling",
    "vision",
    "generation",
    "kvcache",
    "quantize",
    "tokeniz",
    "chat_template",
)


def _loaded(args: list[str], cwd) -> tuple[int, list[str]]:
    """(exit code, every module the run left in sys.modules)."""
    code, loaded, _ = glmtune_inspected(args, cwd, report="sorted(sys.modules)")
    return code, loaded


def _heavy_modules(args: list[str], cwd) -> tuple[int, list[str]]:
    code, loaded = _loaded(args, cwd)
    return code, sorted({m.split(".")[0] for m in loaded} & set(HEAVY))


def model_code(loaded: list[str]) -> list[str]:
    """The modules of `loaded` that plan must not import (NOT_FOR_PLAN, MODEL_CODE)."""
    return [
        m
        for m in loaded
        if any(m == p or m.startswith(p + ".") for p in NOT_FOR_PLAN)
        or m.startswith("glmtune.models.")
        and any(m.rpartition(".")[2].startswith(n) for n in MODEL_CODE)
    ]


def test_probe_without_quantization_imports_no_optional_stack(tmp_path, repo):
    code, heavy = _heavy_modules(
        [
            "mode=probe",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"data.train_file={repo / 'data/samples/train.jsonl'}",
            "data.val_file=null",
        ],
        tmp_path,
    )
    assert code == 0 and heavy == []


def test_plan_imports_planning_only(tmp_path):
    """A 4-GPU plan of packed rows with sequence parallelism reaches every planning path (packed rows and their
    attention path, the SP degree, ZeRO-3 advice): none imports an optional stack, the compiler, model code or a
    tokenizer."""
    code, loaded = _loaded(
        [
            "mode=plan",
            "model=glm4_9b_chat",
            "+hw=a100_40g",
            "data.packing=on",
            "dist.nproc_per_node=4",
            "dist.sequence_parallel=2",
            "data.max_length=8192",
        ],
        tmp_path,
    )
    assert code == 0
    assert sorted({m.split(".")[0] for m in loaded} & set(HEAVY)) == []
    assert "glmtune.plan.planner" in loaded and "torch" in loaded  # the check reads a real plan's process
    assert model_code(loaded) == []


def test_the_plan_check_sees_model_code():
    """The filter above is not blind: the modules a training run loads are caught, whichever folder of
    glmtune/models holds them."""
    caught = model_code(
        [
            "torch._dynamo",
            "torch._dynamo.utils",
            "tiktoken",
            "transformers.models.llama",
            "glmtune.models.docattention",
            "glmtune.models.kernels.docattention",
            "glmtune.models.chatglm.modeling",
            "glmtune.models.modeling_glm4",
            "glmtune.models.tokenization_glm4",
            "glmtune.models.tokenizer_files",
        ]
    )
    assert len(caught) == 10
    assert (
        model_code(
            [
                "torch",
                "torch.nn",
                "transformers",
                "transformers.configuration_utils",
                "glmtune.models",
                "glmtune.models.configuration",
                "glmtune.models.kernels.attnpath",
                "glmtune.models.kernels.ulysses",
                "glmtune.models.presets",
                "glmtune.plan.planner",
            ]
        )
        == []
    )
