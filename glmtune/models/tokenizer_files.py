"""A checkpoint folder's tokenizer, chosen by its files (GLM-4-0414's tokenizer.json, or the format of the ChatGLM
family's tokenizer.model), and the tiny tokenizers that the tiny test checkpoints use (trained on TINY_CORPUS,
deterministic, well under a second)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .chatglm.tokenization_chatglm3 import ChatGLM3Tokenizer, tiny_chatglm3_tokenizer
from .chatglm.tokenization_glm4 import PAT_STR, SPECIAL_TOKENS, GLM4Tokenizer, looks_like_rank_file, tiny_glm4_tokenizer


def load_tokenizer(path: str | os.PathLike, thinking: str = "keep"):
    """The tokenizer of a checkpoint folder: GLM-4-0414's fast tokenizer when it has a tokenizer.json and no
    tokenizer.model (`thinking`: data.thinking, for GLM-Z1's template), else by the format of its tokenizer.model.

    Nothing in the folder is imported or executed: GLM-4's tokenizer.model is a text file of
    "<base64 token bytes> <rank>" lines, ChatGLM3's a SentencePiece protobuf, tokenizer.json is JSON.
    """
    folder = Path(path)
    model_file = folder / "tokenizer.model"
    if not model_file.exists() and (folder / "tokenizer.json").is_file():
        from .glm4_0414.tokenization import Glm4Tokenizer

        return Glm4Tokenizer(folder, thinking)
    try:
        data = model_file.read_bytes()
    except OSError as e:
        raise ValueError(
            f"{model_file}: cannot read tokenizer.model ({e.strerror or e}); point at a GLM-4 or "
            "ChatGLM3 checkpoint folder"
        ) from None
    config_file = folder / "tokenizer_config.json"
    try:  # only its chat template is used: it names GLM-4's tools-block assistant; save_pretrained keeps it
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: not readable JSON ({e})") from None
    chat_template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
    family = GLM4Tokenizer if looks_like_rank_file(data) else ChatGLM3Tokenizer
    try:
        tokenizer = family.from_bytes(data, chat_template=chat_template, source=str(model_file))
    except (ValueError, RuntimeError, UnicodeDecodeError) as e:  # cut short, or not a tokenizer file at all
        message = str(e).splitlines()[0][:160] if str(e).strip() else type(e).__name__
        if message.startswith(str(model_file)):
            raise
        raise ValueError(
            f"{model_file}: not a complete {family.__name__[:-9]} tokenizer ({message}) — copy "
            "tokenizer.model again from the checkpoint"
        ) from None
    # What the tokenizer was made from, for caches of its output (glmtune.data.cache keys on it).
    tokenizer.files_sha256 = hashlib.sha256(data + b"\0" + (chat_template or "").encode()).hexdigest()
    return tokenizer


def write_tiny_tokenizer(out_dir: str | os.PathLike, family: str) -> int:
    """Train a small tokenizer on TINY_CORPUS and save it in the official layout; returns its vocab size.

    Deterministic (same files every call) and well under a second, so tiny checkpoints can be rebuilt freely.
    """
    builders = {"glm4": tiny_glm4_tokenizer, "glm4v": tiny_glm4_tokenizer, "chatglm3": tiny_chatglm3_tokenizer}
    if family not in builders:
        raise ValueError(f"unknown tokenizer family {family!r}; use one of {', '.join(builders)}")
    tokenizer = builders[family](TINY_CORPUS)
    tokenizer.save_pretrained(out_dir)
    return tokenizer.vocab_size


def write_tiny_fast_tokenizer(out_dir: str | os.PathLike, chat_template: str) -> int:
    """The tiny GLM-4 tokenizer's vocabulary as a GLM-4-0414 tokenizer.json (byte-level BPE, merges rebuilt from the
    ranks: each token's splits into two lower-ranked tokens, in rank order; specials after the ordinary ids) and a
    tokenizer_config.json with `chat_template`. Written by tokenizers 0.19, so its merges are "a b" strings; returns
    the vocab size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = tiny_glm4_tokenizer(TINY_CORPUS).ranks
    char = _byte_chars()
    text = {token: "".join(char[b] for b in token) for token in ranks}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
        ]
        merges += [(text[a], text[b]) for a, b in sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))]
    backend = Tokenizer(models.BPE(vocab={text[t]: r for t, r in ranks.items()}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return backend.get_vocab_size()


def _byte_chars() -> list[str]:
    """Byte-level BPE's printable stand-in for each byte value (the GPT-2 table tokenizers' ByteLevel uses): the
    printable Latin-1 bytes stand for themselves, the others take code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# Training text for the tiny tokenizers, written for glmtune: the mix of Chinese, English, JSON and code that
# fine-tuning data has, so token counts (and so sequence lengths and memory) are in a realistic range.
TINY_CORPUS = """\
GLM-4 是一个开源的大语言模型，支持中文和英文的多轮对话、工具调用和长文本推理。
我们使用 LoRA 方法对模型进行微调，只训练很少的参数，显存占用也比全量微调小很多。
训练数据是 JSONL 格式，每一行是一个对话，对话由多条消息组成，每条消息有角色和内容。
角色可以是系统、用户、助手或者观察，观察表示工具返回的结果。
今天北京的天气很好，气温二十一度，适合出去散步。明天可能会下雨，记得带伞。
上海的天气有点闷热，湿度很高，晚上有雷阵雨。广州和深圳的温度都在三十度左右。
请帮我写一首关于春天的诗。春风吹绿了江南的岸边，桃花开满了山坡，燕子从南方飞回来了。
这款牛仔裤采用浅色的面料，版型宽松，穿起来很舒适，适合日常通勤和周末出游。
类型#裤*材质#牛仔布*风格#简约*颜色#浅蓝色*裤长#九分裤
如果显存不够，可以减小批大小，或者打开梯度检查点，也可以使用 DeepSpeed 的 ZeRO 优化。
模型的词表大小是十五万多个词元，嵌入矩阵和输出层占用了不少显存。
学习率设置为五乘以十的负五次方，训练三千步，每五百步保存一次检查点并在验证集上评估。
我想知道怎么做红烧肉：先把五花肉切块焯水，再加糖炒出糖色，然后加酱油、料酒和水，小火炖一个小时。
你好！有什么可以帮你的吗？我可以回答问题、翻译文章、写代码或者总结文档。
用户问：这段代码为什么会报错？助手答：因为变量在使用之前没有定义，请先给它赋值。
中国的首都是北京，长江是中国最长的河流，黄河被称为中华民族的母亲河。
数据集中有一万条样本，其中百分之九十用于训练，百分之十用于验证。
The quick brown fox jumps over the lazy dog. Large language models are trained on text from the web.
Fine-tuning with LoRA adds small low-rank matrices to the attention layers and keeps the base weights frozen.
If the GPU runs out of memory, reduce the batch size, shorten the sequences, or enable gradient checkpointing.
The weather in Paris is sunny today, with a high of 21 degrees and a light wind from the west.
Please summarize the following article in three sentences and list the key points as bullets.
The model generates text one token at a time until it produces a stop token such as <|user|>.
Each training example is a conversation: a system prompt, a user question, and the assistant's answer.
We evaluate the model every 500 steps and keep the checkpoint with the lowest validation loss.
Learning rate: 5e-5, warmup ratio 0.01, weight decay 0.0, max steps 3000, batch size 4 per device.
Hello! How can I help you today? I can answer questions, translate text, and write code for you.
What's the difference between a list and a tuple in Python? A list is mutable; a tuple isn't.
It's 10:30 AM on 2024-06-05, and the training job has finished 1,250 of 3,000 steps (41.7%).
{"role": "user", "content": "What is the weather like in Beijing today?"}
{"role": "assistant", "content": "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Beijing\\"}}"}
{"role": "observation", "content": "{\\"city\\": \\"Beijing\\", \\"temperature\\": 21, \\"condition\\": \\"sunny\\"}"}
{"messages": [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}]}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object",
"properties": {"query": {"type": "string", "description": "搜索关键词"}}, "required": ["query"]}}}
{"name": "get_recommended_books", "arguments": {"interests": ["history", "science fiction"]}}
{"books": ["Sapiens", "A Brief History of Time", "Dune", "The Martian"], "count": 4, "ok": true}
def train(model, data_loader, optimizer, steps=1000):
    model.train()
    for step, batch in enumerate(data_loader):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
        if step >= steps:
            break
    return model


class Config:
    def __init__(self, hidden_size: int = 4096, num_layers: int = 40, vocab_size: int = 151552) -> None:
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.vocab_size = vocab_size


for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)

import json
with open("train.jsonl", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
print(len(rows), "conversations loaded")

SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC LIMIT 10;
$ torchrun --nproc_per_node=8 finetune.py data/ THUDM/glm-4-9b-chat configs/lora.yaml
谢谢你的帮助！😊 不客气，祝你学习愉快。🎉 Thanks a lot! 👍
函数 get_weather 的参数是城市名称，返回当前的温度、湿度和天气状况。
工具调用的结果会以观察的角色返回给模型，模型再根据结果生成最终的回答。
请用 Python 写一个函数，计算一个列表中所有偶数的和，并给出测试用例。
def sum_even(numbers: list[int]) -> int:
    return sum(n for n in numbers if n % 2 == 0)


assert sum_even([1, 2, 3, 4]) == 6
长文本推理需要更长的上下文，显存占用会随着序列长度增长，注意力矩阵是序列长度的平方。
这个问题的答案是四十二。我们可以把问题分解成几个小步骤，一步一步地解决。
"""
