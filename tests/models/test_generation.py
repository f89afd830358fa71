"""Generation details: caller position_ids, sampling settings, the KV-cache batch size, provenance identity."""

import torch

from glmtune.config import InferConfig
from glmtune.infer.sampling import auto_batch_size, per_row_bytes
from glmtune.models import load_model, load_tokenizer, released_config
from glmtune.models.generation import encode_prompt, generate, prompt_batch
from glmtune.models.presets import ensure_tiny

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "你好"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3, then explain."}],
]


def _tiny():
    folder = ensure_tiny("glm4")
    return load_model(folder).eval(), load_tokenizer(folder)


def test_generate_with_caller_position_ids_gives_the_same_tokens():
    model, tok = _tiny()
    batch = prompt_batch([encode_prompt(p, tok) for p in PROMPTS], tok.pad_token_id, None, "cpu")
    # What the official tokenizer returns for a left-padded batch: real tokens count from 0.
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[])
    with torch.no_grad():
        plain = model.generate(**batch, **kwargs)
        given = model.generate(**batch, position_ids=positions, **kwargs)
        # one unpadded prompt with plain 0..n-1 positions, as a user calling the model directly would
        ids = torch.tensor([encode_prompt(PROMPTS[0], tok)[0]])
        single = model.generate(input_ids=ids, **kwargs)
        single_given = model.generate(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], **kwargs)
    assert plain.shape[1] == batch["input_ids"].shape[1] + 20  # no stop token: every step compared
    assert torch.equal(plain, given)
    assert torch.equal(single, single_given)


def test_sampling_follows_the_seed_and_greedy_ignores_it():
    model, tok = _tiny()
    cfg = InferConfig(max_new_tokens=12, batch_size=3, do_sample=True, temperature=1.5, top_p=0.95, top_k=40)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(generate(model, tok, PROMPTS, cfg))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    greedy = InferConfig(max_new_tokens=12, batch_size=3)
    torch.manual_seed(1)
    first = generate(model, tok, PROMPTS, greedy)
    torch.manual_seed(2)
    assert generate(model, tok, PROMPTS, greedy) == first
    # a strong repetition penalty changes greedy output of a model that repeats itself
    assert generate(model, tok, PROMPTS, InferConfig(max_new_tokens=12, batch_size=3, repetition_penalty=5.0)) != first


def test_auto_batch_size_uses_the_kv_cache_term():
    arch = released_config("glm4_9b_chat")
    # 40 layers x 2 KV groups x 128 dims x (K and V) x 2 bytes = 40,960 B per token in bf16
    row = per_row_bytes(arch, "bf16", 500, 256)
    assert row > 40_960 * 756
    assert auto_batch_size(arch, "bf16", 500, 256, prompts=1000, free_bytes=10 * row + 1) == 10
    assert auto_batch_size(arch, "bf16", 500, 256, prompts=3, free_bytes=10 * row) == 3
    assert auto_batch_size(arch, "bf16", 500, 256, prompts=1000, free_bytes=0) == 1
    assert auto_batch_size(arch, "bf16", 500, 256, prompts=1000, free_bytes=None) == 8  # CPU


def test_generate_speed_bench_runs_tiny(repo):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "bench/generate_speed.py", "--tiny", "--prompt-len", "8", "--new-tokens", "2"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 7 and "auto batch" in rows[-1]


def test_grouped_decode_step_equals_the_expanded_attention():
    """One cached decode step (query heads grouped over the stored KV groups) against the same token in a full
    forward (KV expanded to every head), with a left-padded row."""
    from glmtune.models.chatglm.modeling import build_attention_mask

    model, _ = _tiny()
    attn = model.transformer.encoder.layers[0].self_attention.double().eval()
    assert attn.groups < attn.heads
    torch.manual_seed(0)
    x = torch.randn(2, 6, model.config.hidden_size, dtype=torch.float64)
    keep = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    pos = (keep.cumsum(-1) - 1).clamp(min=0)
    rope = model.transformer.rotary_pos_emb(pos, torch.float64).double()
    full, _ = attn(x, build_attention_mask(keep, 6, 0), rope, None, False)
    _, cache = attn(x[:, :5], build_attention_mask(keep[:, :5], 5, 0), rope[:, :5], None, True)
    step, _ = attn(x[:, 5:], build_attention_mask(keep, 1, 5), rope[:, 5:], cache, True)
    torch.testing.assert_close(step[:, 0], full[:, 5])


def test_preallocated_kv_cache_gives_the_same_tokens_and_is_freed():
    from glmtune.models.kvcache import preallocated_kv_cache

    model, tok = _tiny()
    batch = prompt_batch([encode_prompt(p, tok) for p in PROMPTS], tok.pad_token_id, None, "cpu")
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=[])
    attn = model.transformer.encoder.layers[0].self_attention
    with torch.no_grad():
        plain = model.generate(**batch, **kwargs)
        with preallocated_kv_cache(model, 16):
            fast = model.generate(**batch, **kwargs)
            width = batch["input_ids"].shape[1]
            assert attn._kv_buffer[0].shape == (3, attn.groups, width + 16, attn.head_dim)
            past = model(**batch, use_cache=True).past_key_values  # the cache is a view of the buffer
            assert past[0][0].data_ptr() == model.transformer.encoder.layers[0].self_attention._kv_buffer[0].data_ptr()
            assert past[0][0].shape[2] == width
    assert torch.equal(plain, fast)
    assert attn._kv_buffer is None and attn.kv_reserve == 0
