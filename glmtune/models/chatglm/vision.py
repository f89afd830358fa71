"""GLM-4V's vision tower (EVA2-CLIP + GLU adapter) at `transformer.vision`, and the image splice.

Parameter names follow the official `visual.py` of THUDM/glm-4v-9b (facts: ../shared/reference/glm4-facts.md §6):

    vision.patch_embedding.{proj (Conv2d 3->1792, k=s=14), cls_embedding [1, 1792], position_embedding (6401)}
    vision.transformer.layers.N.{input_layernorm, attention.{query_key_value, dense}, mlp.{fc1, fc2},
                                 post_attention_layernorm}                  (63 post-norm layers)
    vision.conv                  Conv2d(1792 -> 4096, k=s=2): 80x80 patch grid -> 40x40 = 1,600 tokens
    vision.linear_proj.{linear_proj, norm1, dense_h_to_4h, gate_proj, dense_4h_to_h}   (GLU, no biases)
    vision.boi, vision.eoi       [1, 1, 4096] learned begin/end-of-image embeddings

The tower turns one image into boi + N patch embeddings + eoi (N = (image_size // patch_size // 2) ** 2,
1,600 at 1120 px), divided by scaling_factor. `splice_images` puts them where the tokenizer left the three
placeholder ids `<|begin_of_image|> <|endoftext|> <|end_of_image|>`: the sequence grows by N - 1 tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

IGNORE_INDEX = -100


def num_image_tokens(vision_config: dict) -> int:
    """Patch embeddings per image after the stride-2 conv (boi/eoi not included): 1,600 for glm-4v-9b."""
    return (vision_config["image_size"] // vision_config["patch_size"] // 2) ** 2


class PatchEmbedding(nn.Module):
    def __init__(self, v: SimpleNamespace):
        super().__init__()
        self.proj = nn.Conv2d(v.in_channels, v.hidden_size, kernel_size=v.patch_size, stride=v.patch_size)
        self.cls_embedding = nn.Parameter(torch.zeros(1, v.hidden_size))
        self.position_embedding = nn.Embedding(v.num_positions, v.hidden_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)  # [B, patches, width]
        cls = self.cls_embedding.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.position_embedding.weight.unsqueeze(0)


class VisionAttention(nn.Module):
    """Full (non-causal) multi-head attention with a fused, biased QKV projection."""

    def __init__(self, v: SimpleNamespace):
        super().__init__()
        self.num_heads = v.num_heads
        self.query_key_value = nn.Linear(v.hidden_size, 3 * v.hidden_size)
        self.dense = nn.Linear(v.hidden_size, v.hidden_size)
        self.dropout_p = v.dropout_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return F.dropout(self.dense(out.transpose(1, 2).reshape(b, n, -1)), self.dropout_p, self.training)


class VisionMLP(nn.Module):
    def __init__(self, v: SimpleNamespace):
        super().__init__()
        self.activation_fn = ACT2FN[v.hidden_act]
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


class VisionLayer(nn.Module):
    """Post-norm: the norm is applied to each sub-layer's output, not its input (unlike the GLM decoder)."""

    def __init__(self, v: SimpleNamespace):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.attention = VisionAttention(v)
        self.mlp = VisionMLP(v)
        self.post_attention_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.input_layernorm(self.attention(x))
        # .to(): the official fix for a tower split over GPUs (GLM-4 issue #350); a no-op on one device.
        return x + self.post_attention_layernorm(self.mlp(x)).to(x.device)


class VisionTransformer(nn.Module):
    def __init__(self, v: SimpleNamespace):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(v.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class GLU(nn.Module):
    """Adapter into the language model's width: linear -> LayerNorm -> GELU -> SwiGLU MLP (ffn_hidden_size)."""

    def __init__(self, hidden: int, ffn_hidden: int, in_features: int):
        super().__init__()
        self.linear_proj = nn.Linear(in_features, hidden, bias=False)
        self.norm1 = nn.LayerNorm(hidden)  # torch's default eps 1e-5, as the official code
        self.act1 = nn.GELU()
        self.dense_h_to_4h = nn.Linear(hidden, ffn_hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.dense_4h_to_h = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.norm1(self.linear_proj(x)))
        return self.dense_4h_to_h(F.silu(self.gate_proj(x)) * self.dense_h_to_4h(x))


class EVA2CLIPModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        v = SimpleNamespace(**config.vision_config)
        self.patch_embedding = PatchEmbedding(v)
        self.transformer = VisionTransformer(v)
        # The official code passes the LM's hidden_size (4096) as in_features: it is the conv's output width.
        self.linear_proj = GLU(config.hidden_size, config.ffn_hidden_size, in_features=config.hidden_size)
        self.conv = nn.Conv2d(v.hidden_size, config.hidden_size, kernel_size=2, stride=2)
        self.boi = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.eoi = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.scaling_factor = v.scaling_factor

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, S, S] (normalised) -> [B, 2 + N, hidden]: boi, N patch embeddings, eoi."""
        x = self.transformer(self.patch_embedding(images))[:, 1:]  # drop CLS
        b, n, w = x.shape
        grid = int(n**0.5)
        x = self.conv(x.view(b, grid, grid, w).permute(0, 3, 1, 2))  # 2x2 patches -> one token
        x = self.linear_proj(x.flatten(2).transpose(1, 2))
        x = torch.cat([self.boi.expand(b, -1, -1).to(x.device), x, self.eoi.expand(b, -1, -1).to(x.device)], dim=1)
        return x / self.scaling_factor


def splice_images(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    features: torch.Tensor,
    image_rows: torch.Tensor,
    boi_id: int,
    eoi_id: int,
    pad_left: bool = False,
    seq_ids: torch.Tensor | None = None,
):
    """Replace `boi <|endoftext|> eoi` in rows `image_rows` with the tower's boi + N patches + eoi.

    As the official ChatGLMModel.forward: all N patches share the position id after boi (eoi and the rest
    keep theirs), their labels are -100 and their attention mask 1. A row listed k times in image_rows (a
    packed row, data/packing.py) has k placeholder triples, filled in order; `seq_ids` (packed rows) gives
    the patches their example's id. Rows that grew less are padded to the longest (mask 0, label -100,
    seq id -1) so the batch stays rectangular: on the right for training batches (a right pad is invisible
    to real tokens under the causal mask), on the left with `pad_left` for left-padded generation batches,
    whose last position must stay the last real token.
    Returns (embeds, position_ids, attention_mask, labels, seq_ids), each [B, S + grow, ...]; seq_ids None
    when not given.
    """
    b, s = input_ids.shape
    n = features.shape[1] - 2
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    features_of: dict[int, list[int]] = {}
    for i, row in enumerate(image_rows.tolist()):
        features_of.setdefault(int(row), []).append(i)
    rows = []
    for row in range(b):
        e, p, m = embeds[row], position_ids[row], mask[row]
        lab = labels[row] if labels is not None else None
        sid = seq_ids[row] if seq_ids is not None else None
        mine = features_of.get(row, [])
        bois = (input_ids[row] == boi_id).nonzero().flatten().tolist()[: len(mine)]
        eois = (input_ids[row] == eoi_id).nonzero().flatten().tolist()
        for boi, feature in reversed(list(zip(bois, mine))):  # from the right: earlier offsets stay valid
            eoi = next((x for x in eois if x > boi), -1)
            if eoi - boi != 2:
                raise ValueError(
                    f"row {row}: expected <|begin_of_image|> X <|end_of_image|>, found eoi {eoi - boi} tokens after boi"
                )
            # .to(): the tower may sit on another GPU than the embeddings (GLM-4 issues #75, #295).
            e = torch.cat([e[:boi], features[feature].to(e.device, e.dtype), e[eoi + 1 :]])
            p = torch.cat([p[: boi + 1], p[boi + 1].repeat(n), p[eoi:]])
            m = torch.cat([m[: boi + 1], m.new_ones(n), m[eoi:]])
            if lab is not None:
                lab = torch.cat([lab[: boi + 1], lab.new_full((n,), IGNORE_INDEX), lab[eoi:]])
            if sid is not None:
                sid = torch.cat([sid[: boi + 1], sid[boi].repeat(n), sid[eoi:]])
        if len(bois) < len(mine):
            raise ValueError(f"row {row}: {len(mine)} image(s) but {len(bois)} <|begin_of_image|> placeholder(s)")
        rows.append((e, p, m, lab, sid))
    width = max(r[0].shape[0] for r in rows)
    out_e, out_p, out_m, out_l, out_s = [], [], [], [], []
    for e, p, m, lab, sid in rows:
        grow = width - e.shape[0]
        if grow and pad_left:
            e = torch.cat([e[:1].expand(grow, -1), e])
            p = torch.cat([p.new_zeros(grow), p])
            m = torch.cat([m.new_zeros(grow), m])
            lab = torch.cat([lab.new_full((grow,), IGNORE_INDEX), lab]) if lab is not None else None
            sid = torch.cat([sid.new_full((grow,), -1), sid]) if sid is not None else None
        elif grow:
            e = torch.cat([e, e[-1:].expand(grow, -1)])
            p = torch.cat([p, p[-1:] + torch.arange(1, grow + 1, device=p.device)])
            m = torch.cat([m, m.new_zeros(grow)])
            lab = torch.cat([lab, lab.new_full((grow,), IGNORE_INDEX)]) if lab is not None else None
            sid = torch.cat([sid, sid.new_full((grow,), -1)]) if sid is not None else None
        out_e.append(e), out_p.append(p), out_m.append(m), out_l.append(lab), out_s.append(sid)
    padded = any(r[0].shape[0] < width for r in rows)
    new_mask = torch.stack(out_m) if attention_mask is not None or padded else None
    return (
        torch.stack(out_e),
        torch.stack(out_p),
        new_mask,
        torch.stack(out_l) if labels is not None else None,
        torch.stack(out_s) if seq_ids is not None else None,
    )


# CLIP's normalisation constants (the official tokenizer's transforms.Normalize).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def load_image(path, image_size: int) -> torch.Tensor:
    """The official preprocessing with Pillow and torch only (torchvision is not usable here):
    RGB, bicubic resize to image_size x image_size, scale to [0, 1], CLIP mean/std. -> [3, S, S] float32."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB").resize((image_size, image_size), Image.BICUBIC)
        data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    x = data.view(image_size, image_size, 3).permute(2, 0, 1).float() / 255.0
    return (x - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
