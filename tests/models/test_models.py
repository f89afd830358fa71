"""glmtune's GLM-4 / ChatGLM3 model against the official layout and an independent float64 reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from glmtune.models import (
    ChatGLMForConditionalGeneration,
    GLMConfig,
    build_meta_model,
    enable_checkpointing,
    load_model,
    make_tiny_checkpoint,
    released_config,
)
from glmtune.models.chatglm.layers import MLP, RMSNorm, RotaryEmbedding, SelfAttention, apply_rotary
from glmtune.models.loading import TINY_ARCH


def tiny_config(**kw) -> GLMConfig:
    return GLMConfig(**{**TINY_ARCH, "padded_vocab_size": 96, "rope_ratio": 500.0, **kw})


def tiny_model(seed=0, dtype=torch.float64, **kw) -> ChatGLMForConditionalGeneration:
    torch.manual_seed(seed)
    model = ChatGLMForConditionalGeneration(tiny_config(**kw)).to(dtype)
    with torch.no_grad():  # non-trivial norm weights and biases so a wrong formula cannot hide
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model.eval()


# ---------------------------------------------------------------- official names, shapes, counts


def test_glm4_9b_chat_on_meta_has_official_names_shapes_and_count():
    model = build_meta_model(released_config("glm4_9b_chat"))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) == 9_399_951_360
    assert shapes["transformer.embedding.word_embeddings.weight"] == (151552, 4096)
    assert shapes["transformer.output_layer.weight"] == (151552, 4096)
    assert shapes["transformer.encoder.final_layernorm.weight"] == (4096,)
    layer = "transformer.encoder.layers.39."
    assert shapes[layer + "input_layernorm.weight"] == (4096,)
    assert shapes[layer + "self_attention.query_key_value.weight"] == (4608, 4096)
    assert shapes[layer + "self_attention.query_key_value.bias"] == (4608,)
    assert shapes[layer + "self_attention.dense.weight"] == (4096, 4096)
    assert shapes[layer + "post_attention_layernorm.weight"] == (4096,)
    assert shapes[layer + "mlp.dense_h_to_4h.weight"] == (27392, 4096)
    assert shapes[layer + "mlp.dense_4h_to_h.weight"] == (4096, 13696)
    assert len(shapes) == 2 + 1 + 40 * 7  # nothing beyond the official tensors
    assert all(v.is_meta for v in model.state_dict().values())


def test_chatglm3_6b_on_meta_count():
    model = build_meta_model(released_config("chatglm3_6b"))
    assert sum(p.numel() for p in model.parameters()) == 6_243_584_000
    assert model.state_dict()["transformer.embedding.word_embeddings.weight"].shape == (65024, 4096)


# ---------------------------------------------------------------- components vs float64 references


def test_rmsnorm_matches_float64_formula():
    torch.manual_seed(1)
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    ref = norm.weight.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm.double()(x), ref)
    # bf16 input: variance in fp32, result cast back to bf16
    xb = x.to(torch.bfloat16)
    assert norm.float()(xb).dtype == torch.bfloat16


def _complex_rotary_reference(x, positions, rot_dims, base):
    """Rotate pairs (x[2i], x[2i+1]) for the first rot_dims dims by angle pos * base^(-2i/rot_dims)."""
    out = x.clone()
    pairs = torch.view_as_complex(x[..., :rot_dims].reshape(*x.shape[:-1], rot_dims // 2, 2).contiguous())
    # The reference computes angles and their cos/sin in fp32 (`idx_theta = outer(seq, theta).float()`); doing
    # the same here keeps the comparison exact to float64 rounding instead of fp32's ~1e-7.
    theta = 1.0 / (base ** (torch.arange(0, rot_dims, 2, dtype=torch.float32) / rot_dims))
    angle = positions.float()[:, None] * theta  # [S, rot/2], fp32
    rotated = pairs * torch.polar(torch.ones_like(angle), angle).to(torch.complex128)
    out[..., :rot_dims] = torch.view_as_real(rotated).flatten(-2)
    return out


def test_partial_interleaved_rotary_matches_complex_reference():
    torch.manual_seed(0)
    cfg = tiny_config()
    rope = RotaryEmbedding(cfg)
    x = torch.randn(2, 4, 7, cfg.kv_channels, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 100]])
    got = apply_rotary(x, rope(pos, torch.float64).double())
    for b in range(2):
        ref = _complex_rotary_reference(x[b], pos[b], cfg.kv_channels // 2, 10000.0 * 500)
        # The angles are computed in fp32, as the reference does: at position 100 that is ~1e-7 rad of
        # rounding, so float64's default 1e-7 tolerance fails on some draws.
        torch.testing.assert_close(got[b], ref, rtol=1e-5, atol=1e-6)
    # the second half of each head passes through untouched
    torch.testing.assert_close(got[..., cfg.kv_channels // 2 :], x[..., cfg.kv_channels // 2 :])


def test_swiglu_mlp_matches_float64_formula():
    torch.manual_seed(2)
    cfg = tiny_config()
    mlp = MLP(cfg).double()
    x = torch.randn(2, 3, cfg.hidden_size, dtype=torch.float64)
    w1, w2 = mlp.dense_h_to_4h.weight[: cfg.ffn_hidden_size], mlp.dense_h_to_4h.weight[cfg.ffn_hidden_size :]
    gate, up = x @ w1.T, x @ w2.T
    ref = (gate / (1 + torch.exp(-gate)) * up) @ mlp.dense_4h_to_h.weight.T
    torch.testing.assert_close(mlp(x), ref)


def _attention_reference(attn: SelfAttention, x, positions, cfg):
    """Per-head loop: query head h reads KV group h // (heads / groups); causal softmax in float64."""
    hd, nh, ng = cfg.kv_channels, cfg.num_attention_heads, cfg.kv_groups
    qkv = x @ attn.query_key_value.weight.T + attn.query_key_value.bias
    q, k, v = qkv[:, : nh * hd], qkv[:, nh * hd : (nh + ng) * hd], qkv[:, (nh + ng) * hd :]
    S = x.shape[0]
    heads = []
    for h in range(nh):
        g = h // (nh // ng)
        qh = _complex_rotary_reference(q[:, h * hd : (h + 1) * hd], positions, hd // 2, 10000.0 * cfg.rope_ratio)
        kh = _complex_rotary_reference(k[:, g * hd : (g + 1) * hd], positions, hd // 2, 10000.0 * cfg.rope_ratio)
        scores = qh @ kh.T / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v[:, g * hd : (g + 1) * hd])
    return torch.cat(heads, -1) @ attn.dense.weight.T


def test_gqa_attention_matches_per_head_reference():
    cfg = tiny_config()
    model = tiny_model()
    attn = model.transformer.encoder.layers[0].self_attention
    x = torch.randn(1, 6, cfg.hidden_size, dtype=torch.float64)
    pos = torch.arange(6)[None]
    rope = model.transformer.rotary_pos_emb(pos, torch.float64).double()
    got, _ = attn(x, None, rope, None, False)
    torch.testing.assert_close(got[0], _attention_reference(attn, x[0], pos[0], cfg))


def _model_reference(model, ids):
    """Whole forward in float64 from the state dict alone: pre-norm blocks, final norm, untied head."""
    cfg, sd = model.config, {k: v.double() for k, v in model.state_dict().items()}
    eps = cfg.layernorm_epsilon

    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    x = sd["transformer.embedding.word_embeddings.weight"][ids]
    pos = torch.arange(len(ids))
    for i, layer in enumerate(model.transformer.encoder.layers):
        p = f"transformer.encoder.layers.{i}."
        x = x + _attention_reference(layer.self_attention, norm(x, sd[p + "input_layernorm.weight"]), pos, cfg)
        h = norm(x, sd[p + "post_attention_layernorm.weight"]) @ sd[p + "mlp.dense_h_to_4h.weight"].T
        gate, up = h.chunk(2, -1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.dense_4h_to_h.weight"].T
    x = norm(x, sd["transformer.encoder.final_layernorm.weight"])
    return x @ sd["transformer.output_layer.weight"].T


def test_full_forward_and_loss_match_float64_reference():
    model = tiny_model()
    ids = torch.tensor([5, 17, 3, 88, 42, 7, 61, 2])
    labels = ids.clone()
    labels[:3] = -100
    out = model(input_ids=ids[None], labels=labels[None])
    ref = _model_reference(model, ids)
    torch.testing.assert_close(out.logits[0], ref)
    ref_loss = F.cross_entropy(ref[:-1][labels[1:] != -100], labels[1:][labels[1:] != -100])
    torch.testing.assert_close(out.loss, ref_loss)
    model.loss_chunk_tokens = 3  # the lower-memory loss gives the same value
    torch.testing.assert_close(model(input_ids=ids[None], labels=labels[None]).loss, ref_loss)


def test_padding_masks_do_not_change_real_tokens():
    model = tiny_model()
    a, b = torch.tensor([4, 9, 13, 21, 30]), torch.tensor([8, 2, 77])
    ref_a, ref_b = model(input_ids=a[None]).logits[0], model(input_ids=b[None]).logits[0]
    # right padding (training collator): positions 0.. for real tokens
    ids = torch.tensor([[4, 9, 13, 21, 30], [8, 2, 77, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    out = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[1, :3], ref_b)
    torch.testing.assert_close(out[0], ref_a)
    # left padding (generation): positions from the mask, as the official tokenizer's position_ids
    ids = torch.tensor([[4, 9, 13, 21, 30], [0, 0, 8, 2, 77]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1, 2:], ref_b)


# ---------------------------------------------------------------- generation


def test_greedy_generate_with_kv_cache_equals_without_cache():
    model = tiny_model(dtype=torch.float32)
    prompts = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    cached = model.generate(prompts, use_cache=True, **kw)
    uncached = model.generate(prompts, use_cache=False, **kw)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, uncached)
    # the padded row decodes exactly as the same prompt alone
    alone = model.generate(prompts[:1, 2:], max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(alone[0], cached[0, 2:])


def test_kv_cache_holds_only_the_kv_groups():
    model = tiny_model(dtype=torch.float32)
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    k, v = out.past_key_values[0]
    assert k.shape == (1, model.config.multi_query_group_num, 3, model.config.kv_channels) == v.shape


# ---------------------------------------------------------------- gradient checkpointing


def _saved_bytes_and_grads(model, ids):
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return sum(saved.values()), grads


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_engages_shrinks_saved_activations_and_keeps_gradients(reentrant):
    model = tiny_model(dtype=torch.float32, num_layers=4, padded_vocab_size=64).train()
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    plain_bytes, plain_grads = _saved_bytes_and_grads(model, ids)
    assert enable_checkpointing(model, use_reentrant=reentrant) == 1
    assert model.transformer.encoder.gradient_checkpointing
    ckpt_bytes, ckpt_grads = _saved_bytes_and_grads(model, ids)
    # Without checkpointing every layer keeps ~20 tensors of [B, S, >=hidden]; with it, only the layer inputs
    # (B*S*hidden*4 bytes each) survive the forward, plus the embedding/loss tensors outside the layers.
    per_layer_input = 2 * 48 * model.config.hidden_size * 4
    assert ckpt_bytes < plain_bytes / 3
    assert plain_bytes - ckpt_bytes > 4 * 5 * per_layer_input
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------- checkpoint folders


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_tiny_checkpoint_roundtrip_plain_and_sharded(tmp_path, family):
    src = make_tiny_checkpoint(tmp_path / "tiny", family=family, seed=3)
    assert {"config.json", "model.safetensors", "tokenizer.model"} <= {p.name for p in src.iterdir()}
    model = load_model(src).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    ref = _logits(model, ids)
    torch.manual_seed(3)  # the in-memory model make_tiny_checkpoint built from this seed
    fresh = ChatGLMForConditionalGeneration(model.config).eval()
    torch.testing.assert_close(_logits(fresh, ids), ref, rtol=0, atol=0)
    for safe, name in [(True, "model.safetensors.index.json"), (False, "pytorch_model.bin.index.json")]:
        out = tmp_path / f"sharded-{safe}"
        model.save_pretrained(out, safe_serialization=safe, max_shard_size="20KB")
        assert (out / name).is_file() and len(list(out.glob("*.safetensors" if safe else "*.bin"))) > 2
        torch.testing.assert_close(_logits(load_model(out).eval(), ids), ref, rtol=0, atol=0)


def test_load_model_dtype_and_meta(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "tiny")
    assert next(load_model(src, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    meta = load_model(src, device="meta")
    assert all(p.is_meta for p in meta.parameters())


def test_remote_code_in_folder_is_never_imported(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "tiny")
    (src / "modeling_chatglm.py").write_text("raise RuntimeError('remote code was imported')\n")
    (src / "tokenization_chatglm.py").write_text("raise RuntimeError('remote code was imported')\n")
    (src / "configuration_chatglm.py").write_text("raise RuntimeError('remote code was imported')\n")
    cfg = (src / "config.json").read_text()
    (src / "config.json").write_text(
        cfg.replace(
            '"architectures"',
            '"auto_map": {"AutoConfig": '
            '"configuration_chatglm.ChatGLMConfig", "AutoModelForCausalLM": '
            '"modeling_chatglm.ChatGLMForConditionalGeneration"}, "architectures"',
        )
    )
    model = load_model(src)
    assert type(model) is ChatGLMForConditionalGeneration
    from glmtune.models import load_tokenizer

    assert load_tokenizer(src).encode("hello") != []
    # the opt-in path does run it, which is how we know the file would have failed
    with pytest.raises(RuntimeError, match="remote code was imported"):
        load_model(src, trust_remote_code=True)


def test_checkpoint_with_inv_freq_buffer_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    src = make_tiny_checkpoint(tmp_path / "tiny")
    weights = load_file(src / "model.safetensors")
    weights["transformer.rotary_pos_emb.inv_freq"] = torch.ones(4)  # as the official files store it
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    load_model(src)


def test_missing_weights_are_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    src = make_tiny_checkpoint(tmp_path / "tiny")
    weights = load_file(src / "model.safetensors")
    del weights["transformer.output_layer.weight"]
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="output_layer"):
        load_model(src)


def test_rotary_never_reads_its_buffer_device():
    """ZeRO-3 on a GPU left `inv_freq` on the CPU ("Expected all tensors to be on the same device"). The table
    is computed on the positions' device, so a buffer elsewhere (here: meta) changes nothing, and a model built
    on meta and materialised with to_empty (garbage buffer) gives the reference logits."""
    torch.manual_seed(0)
    config = GLMConfig(**TINY_ARCH, padded_vocab_size=256)
    ref = ChatGLMForConditionalGeneration(config).eval()
    ids = torch.randint(0, 256, (2, 12))
    expected = ref(input_ids=ids).logits
    rope = ref.transformer.rotary_pos_emb
    rope.inv_freq = rope.inv_freq.to("meta")
    assert torch.equal(ref(input_ids=ids).logits, expected)
    with torch.device("meta"):
        built = ChatGLMForConditionalGeneration(config)
    assert built.transformer.rotary_pos_emb.inv_freq.device.type == "meta"  # created on the context's device
    built = built.to_empty(device="cpu").eval()
    built.load_state_dict(ref.state_dict(), strict=False)
    assert torch.equal(built(input_ids=ids).logits, expected)


def test_offloaded_checkpoints_give_the_same_step():
    """Checkpointed block inputs kept in CPU memory (plan rung offload_checkpoints): same loss, same grads."""
    torch.manual_seed(0)
    model = ChatGLMForConditionalGeneration(GLMConfig(**TINY_ARCH, padded_vocab_size=256))
    model.config.use_cache = False
    enable_checkpointing(model)
    model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, 256, (2, 16))
    results = []
    for offload in (False, True):
        model.zero_grad()
        model.transformer.encoder.offload_checkpoints = offload
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    assert len(results[0][1]) > 0 and all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
