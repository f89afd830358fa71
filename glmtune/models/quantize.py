"""model.quantize=nf4|int8: glmtune's GLM model with bitsandbytes base weights (QLoRA), loaded shard by shard.

A loader of its own rather than transformers' `BitsAndBytesConfig`: transformers 4.40.2 declares
bitsandbytes unavailable without CUDA (`is_bitsandbytes_available()` needs `torch.cuda.is_available()`), so
that path could never run in CI, and it brings the whole generic quantizer machinery for six Linear kinds.
Here the model is built with empty (meta) parameters, every Linear of the GLM blocks becomes a bnb
`Linear4bit` (NF4, 64-element blocks) or `Linear8bitLt` (LLM.int8, per-row scales), and each checkpoint
tensor is read once (safetensors: one tensor at a time), moved to the target device and quantized there.
The GPU never holds more than one unquantized layer beside the quantized model (the largest, GLM-4-9B's
dense_h_to_4h: 4096 x 27392 x 2 B = 224 MB in bf16); host memory holds one tensor (safetensors) or one
shard (.bin).

Kept in the compute dtype (bf16 on cards that have it):
- embedding and output_layer: 2 x 151,552 x 4096 x 2 B = 2.5 GB on GLM-4-9B. The LM head's error would land
  straight on the logits (transformers skips the head for the same reason); the embedding is not a Linear.
- norms and biases (a few MB); they are not cast to fp32 either: RMSNorm already computes in fp32, and the
  bf16 checkpoint values are exact in bf16, so peft's `prepare_model_for_kbit_training` upcast would buy
  nothing and cost 2 B/param more on every non-quantized weight (+2.3 GiB: embedding and head go fp32).
- GLM-4V's vision tower (4.5 B parameters, 8.4 GiB bf16 vs ~2.2 GiB NF4). It is frozen and adapter-free, so
  LoRA cannot compensate an error in its 1,600 image embeddings, and it runs forward once per image. With an
  NF4 language model glm-4v-9b already fits a 24 GB card with the tower in bf16 (README table), so the
  tower stays exact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .chatglm.modeling import ChatGLMForConditionalGeneration
from .glm4_0414.modeling import Glm4ForCausalLM
from .loading import _as_dtype, load_config

QUANTIZED = ("nf4", "int8")
# LLM.int8()'s outlier threshold (Dettmers et al. 2022; transformers' default): input columns with a
# magnitude above 6 run in 16-bit, the rest in int8. Only the CUDA kernel uses it; CPU dequantizes.
INT8_THRESHOLD = 6.0


def quantized_linear_names(model: nn.Module) -> list[str]:
    """Linears that take quantized weights: those of the decoder blocks (the model's `block_prefix`: ChatGLM's
    transformer.encoder., GLM-4-0414's model.layers.), not the vision tower, not the LM head."""
    return [n for n, m in model.named_modules() if n.startswith(model.block_prefix) and isinstance(m, nn.Linear)]


class _QuantizedCount:
    """transformers 4.40's `num_parameters` (the Trainer's FLOP count) reads 4-bit weights through an `hf_quantizer`
    that only its own loader sets, and refuses without CUDA: count them from their quantization state."""

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        skip = {f"{n}.weight" for n, m in self.named_modules() if exclude_embeddings and isinstance(m, nn.Embedding)}
        return sum(
            p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else p.numel()
            for n, p in self.named_parameters()
            if n not in skip and (p.requires_grad or not only_trainable)
        )


class QuantizedGLM(_QuantizedCount, ChatGLMForConditionalGeneration):
    """glmtune's ChatGLM model with bitsandbytes Linears."""


class QuantizedGlm4(_QuantizedCount, Glm4ForCausalLM):
    """glmtune's GLM-4-0414 model with bitsandbytes Linears."""


def _bnb():
    """bitsandbytes, imported on first use. A run's config check (config/validate.py) has found it installed; a
    direct caller without it gets the same advice as an ImportError."""
    # Before the import, which logs it; addFilter never adds the same filter twice.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_drop_kernels_hint)
    try:
        import bitsandbytes
    except ImportError:
        raise ImportError(
            "model.quantize needs bitsandbytes — pip install 'glmtune[quant]' (or model.quantize=none)"
        ) from None
    return bitsandbytes


def _quantized_layer(old: nn.Linear, quantize: str, dtype: torch.dtype, double_quant: bool) -> nn.Module:
    bnb = _bnb()
    bias = old.bias is not None
    if quantize == "nf4":
        return bnb.nn.Linear4bit(
            old.in_features,
            old.out_features,
            bias=bias,
            compute_dtype=dtype,
            compress_statistics=double_quant,
            quant_type="nf4",
            device="meta",
        )
    layer = bnb.nn.Linear8bitLt(
        old.in_features, old.out_features, bias=bias, has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta"
    )
    # peft 0.11 copies this flag when it wraps the layer; bitsandbytes 0.45+ dropped it (backward is always
    # the memory-efficient one now), so the wrap failed with an AttributeError.
    layer.state.memory_efficient_backward = False
    return layer


def _quantized_weight(
    tensor: torch.Tensor, layer: nn.Module, quantize: str, dtype: torch.dtype, double_quant: bool, device: torch.device
) -> nn.Parameter:
    """The parameter quantizes itself when moved to the device (bitsandbytes' own `.to`)."""
    bnb = _bnb()
    if quantize == "nf4":  # quantized from the compute dtype, so dequantization returns that dtype
        return bnb.nn.Params4bit(
            tensor.to(dtype), requires_grad=False, quant_type="nf4", compress_statistics=double_quant, module=layer
        ).to(device)
    return bnb.nn.Int8Params(tensor, requires_grad=False, has_fp16_weights=False).to(device)


def _never_pack_on_cpu(layer: nn.Module) -> None:
    """bitsandbytes 0.50 on a CPU with AVX512-BF16 rewrites an NF4 weight in place at its first no-grad forward
    in eval mode (an evaluation, a generation): codes retiled for its bf16 inference kernel, block scales cast
    to bf16 and transposed, double-quant scales expanded. Its way back (run by a later training forward, `.to()`
    or `state_dict()`) is "best-effort": without double quant the scales stay transposed (a layer's weights
    off by up to 0.22 with |w| <= 1.31), with it they are re-quantized from bf16 (1.7e-3), so the training
    steps after an evaluation used other base weights than those before (tests/models/test_nf4_cpu.py).

    The choice is a per-layer flag, set from the CPU at construction; cleared, the layer dequantizes and
    multiplies in the compute dtype in every mode, as training does and as every other CPU does. The codes and
    scales are then never rewritten, by construction, and an evaluation computes the same on both CPU kinds.
    The price: CPU NF4 inference on such CPUs forgoes the bf16 kernel (GPUs never take this path)."""
    layer.support_avx512bf16_for_cpu = False


# Logged by bitsandbytes' import on CPUs with AVX512-BF16 when the optional `kernels` package (which would
# fetch a compiled kernel from the Hub) is missing. It is about the packed inference kernel above, which
# glmtune never uses, so it is lowered to INFO: below the console, still in rank<N>.log (launch/quiet.py
# does the same for the whole process; this covers a direct caller of the loader).
_KERNELS_HINT = "Failed to load CPU gemm_4bit_forward"


def _drop_kernels_hint(record: logging.LogRecord) -> bool:
    if str(record.msg).startswith(_KERNELS_HINT):
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True


@contextlib.contextmanager
def peft_without_bitsandbytes() -> Iterator[None]:
    """peft 0.11 imports bitsandbytes whenever it is installed, to try its k-bit LoRA layers on every adapted
    layer (~2 s of imports, and on CPUs with AVX512-BF16 a warning about an optional 'kernels' package). A
    model that is not quantized has no bitsandbytes layer for them to match, so while peft adapts one, its two
    availability checks answer False. A quantized model's loader has imported bitsandbytes already: then
    nothing changes."""
    if "bitsandbytes" in sys.modules:
        yield
        return
    from peft.tuners.lora import model as lora_model

    saved = lora_model.is_bnb_available, lora_model.is_bnb_4bit_available
    lora_model.is_bnb_available = lora_model.is_bnb_4bit_available = lambda: False
    try:
        yield
    finally:
        lora_model.is_bnb_available, lora_model.is_bnb_4bit_available = saved


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The checkpoint's weight files: a sharded index's shards, or the single file."""
    folder = Path(path)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            shards = json.loads((folder / index).read_text())["weight_map"].values()
            return [folder / name for name in sorted(set(shards))]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    raise FileNotFoundError(f"{folder}: no model*.safetensors or pytorch_model*.bin — is it a checkpoint folder?")


def _tensors(files: list[Path]):
    from safetensors import safe_open

    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


def load_quantized(
    path: str | os.PathLike,
    quantize: str,
    dtype: torch.dtype | str,
    device: str | torch.device | None = None,
    double_quant: bool = True,
    tensors=None,
) -> nn.Module:
    """glmtune's model with NF4 or int8 weights in the GLM blocks; `dtype` is the compute dtype of everything.

    device None: cuda:LOCAL_RANK when there is a GPU (each data-parallel rank holds its own copy), else CPU.
    tensors: (name, tensor) pairs to load instead of the folder's weight files (whose config.json still gives
    the architecture): bench/gpu_memory.py's random weights, made one tensor at a time on the GPU."""
    from accelerate import init_empty_weights

    if quantize not in QUANTIZED:
        raise ValueError(f"quantize={quantize!r}: use one of {', '.join(QUANTIZED)}")
    dtype = _as_dtype(dtype)
    if device is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    config = load_config(path)
    with init_empty_weights(include_buffers=False):  # parameters on meta; the rotary buffer is computed
        model = (QuantizedGlm4 if config.model_type == "glm4" else QuantizedGLM)(config)
    names = set(quantized_linear_names(model))
    for name in names:
        parent, child = name.rsplit(".", 1)
        setattr(
            model.get_submodule(parent),
            child,
            _quantized_layer(model.get_submodule(name), quantize, dtype, double_quant),
        )
    params, unexpected = dict(model.named_parameters()), []
    for name, tensor in tensors if tensors is not None else _tensors(weight_files(path)):
        if name not in params:
            unexpected.append(name)
            continue
        owner, leaf = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        if leaf == "weight" and owner in names:
            module.weight = _quantized_weight(tensor, module, quantize, dtype, double_quant, device)
        else:
            module._parameters[leaf] = nn.Parameter(tensor.to(device=device, dtype=dtype))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(
            f"{path}: checkpoint lacks {len(missing)} weights, e.g. "
            f"{', '.join(missing[:3])} — is it a complete GLM-4/ChatGLM3 checkpoint?"
        )
    unexpected = [n for n in unexpected if not n.endswith("rotary_pos_emb.inv_freq")]
    if unexpected:
        logging.getLogger(__name__).warning(
            "%s: %d checkpoint tensors not used, e.g. %s", path, len(unexpected), ", ".join(unexpected[:3])
        )
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device)
    if quantize == "nf4":
        for name in names:
            _never_pack_on_cpu(model.get_submodule(name))
    if quantize == "int8":  # bitsandbytes logs "inputs will be cast ... to float16" on every int8 matmul call
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    # peft wraps bnb layers in its k-bit LoRA classes only when the model says it is loaded in 4/8 bit.
    model.is_loaded_in_4bit, model.is_loaded_in_8bit = quantize == "nf4", quantize == "int8"
    model.config.name_or_path = str(path)
    return model.eval()


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor that holds weights: the parameters (packed 4-bit / int8 data included) plus the quantization
    state bitsandbytes keeps beside them (NF4 absmax, nested scales and code tables; int8 row scales)."""
    tensors = list(model.parameters())
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:
            tensors += [state.absmax, state.code, state.offset]
            if state.state2 is not None:
                tensors += [state.state2.absmax, state.state2.code]
        for holder in (weight, getattr(module, "state", None)):
            tensors.append(getattr(holder, "SCB", None))
    return [t for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta]


def weight_storage_bytes(model: nn.Module) -> int:
    """Bytes the model's weights really occupy (weight_tensors), each storage counted once."""
    seen, total = set(), 0
    for t in weight_tensors(model):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
