"""Batched generation for concurrent requests: a queue, one worker thread, and `model.generate` per batch.

Requests are admitted in the HTTP thread (`Engine.admit`: the prompt and max_tokens must fit the model's
context, and their KV cache the memory free after the weights loaded, else an OpenAI-style 400) and queued.
The worker takes the oldest request, waits BATCH_WINDOW_S for others that arrive with it, and decodes every
queued request with the same sampling settings in one left-padded batch (models/generation.prompt_batch, the
KV cache allocated once per batch by models/kvcache.py), up to serve.max_batch rows and the free memory.
Each row stops on its own: at GLM-4's stop ids, its max_tokens, a stop string or a client that went away
(a StoppingCriteria per row); the batch ends when every row has. Tokens reach each request as they are
decoded (a streamer per batch), so streaming and plain requests share the batch.

Greedy rows in a left-padded batch give the tokens they give alone (tests/infer/test_infer.py checks batched ==
single), so a request's reply does not depend on what it was batched with. A sampled request with a `seed`
runs alone: the random stream is then its own, and the same seed gives the same reply.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..config.units import GIB
from ..infer.sampling import per_row_bytes
from ..models.generation import generation_kwargs, prompt_batch
from ..models.kvcache import preallocated_kv_cache
from ..plan.estimate import image_extra_tokens
from .jobs import Job, RowsDone, RowStreamer, shutting_down
from .protocol import ApiError, ChatRequest

log = logging.getLogger("glmtune.serve")
BATCH_WINDOW_S = 0.02  # a request waits this long for others to share its batch: 20 ms of latency, once


class Engine:
    def __init__(self, model, tokenizer, max_batch: int, free_bytes: int | None, default_max_tokens: int):
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.free_bytes = free_bytes  # after the weights loaded, minus a reserve; None = not checked
        self.default_max_tokens = default_max_tokens
        config = model.config
        # positions the model was built for (GLM: the RoPE table's length); a config without one is not limited
        self.context = int(getattr(config, "seq_length", 0) or getattr(config, "max_position_embeddings", 0)) or 2**62
        self.image_tokens = image_extra_tokens(config) if getattr(config, "vision_config", None) else 0
        self.dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.dtype, "fp32")
        self.queue: queue.Queue[Job] = queue.Queue()
        self.pending: list[Job] = []  # taken from the queue, waiting for a batch with their settings
        self.stopping = False
        self.closed = False  # the worker has answered every queued job and takes no more (under self.lock)
        self.lock = threading.Lock()
        self.batches = 0
        self.thread = threading.Thread(target=self._work, name="glmtune-serve-engine", daemon=True)

    def row_bytes(self, prompt_tokens: int, new_tokens: int) -> int:
        return per_row_bytes(self.model.config, self.dtype, prompt_tokens, new_tokens)

    def admit(self, request: ChatRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """A job for the request, or ApiError (400) when it cannot fit the context or the free memory."""
        prompt = len(request.ids) + (self.image_tokens if request.image else 0)
        room = self.context - prompt
        if room < 1:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context} tokens; the messages take "
                f"{prompt} — shorten them",
                "messages",
                "context_length_exceeded",
            )
        asked = request.max_tokens
        if asked is not None and asked > room:
            raise ApiError(
                400,
                f"max_tokens={asked} with the messages' {prompt} tokens exceeds this model's "
                f"context of {self.context} tokens — ask for at most {room}",
                "max_tokens",
                "context_length_exceeded",
            )
        new = asked if asked is not None else min(self.default_max_tokens, room)
        if self.free_bytes is not None and self.row_bytes(prompt, new) > self.free_bytes:
            raise ApiError(
                400,
                f"{prompt} prompt tokens + max_tokens={new} need "
                f"{self.row_bytes(prompt, new) / GIB:.2f} GiB of KV cache and activations; "
                f"{self.free_bytes / GIB:.2f} GiB are free beside the weights — lower max_tokens or "
                "shorten the messages",
                "max_tokens",
                "insufficient_memory",
            )
        return Job(request, new, prompt, loop)

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.closed:
                raise shutting_down()
            self.queue.put(job)

    def start(self) -> None:
        """Warm up, then take requests. The first generate() imports torch._dynamo (transformers asks whether it
        is compiling: 1.5 s, 12 s on a busy 2-core host), which the first request would otherwise wait for."""
        tok = self.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        with torch.no_grad():
            self.model.generate(
                **prompt_batch([(ids, None)], tok.pad_token_id, None, self.model.get_input_embeddings().weight.device),
                max_new_tokens=1,
                pad_token_id=tok.pad_token_id,
                do_sample=False,
            )
        self.thread.start()

    def halt(self) -> None:
        """Stop decoding at the next token: the rows cut short and every waiting request get a 503 (the stream
        of a streamed one ends with that error and [DONE]); returns at once, the worker ends on its own."""
        self.stopping = True

    def stop(self, timeout: float = 10.0) -> None:
        """halt(), and wait for the worker to end."""
        self.halt()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # --- the worker thread ------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self.stopping:
            try:
                batch = self._take()
            except Exception as err:  # noqa: BLE001 - a bug: the worker lives on, or every later request would hang
                log.exception("taking a batch failed")
                for job in self.pending:
                    job.post(
                        "error",
                        ApiError(500, f"batching failed: {type(err).__name__}: {err}", None, None, "server_error"),
                    )
                self.pending = []
                continue
            if batch:
                self._run(batch)
        with self.lock:
            self.closed = True
            waiting, self.pending = self.pending + list(self.queue.queue), []
        for job in waiting:
            job.post("error", shutting_down())

    def _take(self) -> list[Job]:
        """The oldest job and every waiting one that can share its batch (settings, max_batch, memory)."""
        if not self.pending:
            try:
                self.pending.append(self.queue.get(timeout=0.1))
            except queue.Empty:
                return []
            time.sleep(BATCH_WINDOW_S)
        while True:
            try:
                self.pending.append(self.queue.get_nowait())
            except queue.Empty:
                break
        self.pending = [job for job in self.pending if not job.cancelled]
        if not self.pending:
            return []
        key, batch = self.pending[0].key(), []
        for job in self.pending:
            if job.key() != key or len(batch) >= self.max_batch:
                continue
            if batch and self.free_bytes is not None:
                rows = batch + [job]
                need = len(rows) * self.row_bytes(
                    max(j.prompt_tokens for j in rows), max(j.max_new_tokens for j in rows)
                )
                if need > self.free_bytes:
                    continue
            batch.append(job)
        self.pending = [job for job in self.pending if job not in batch]
        return batch

    def _run(self, batch: list[Job]) -> None:
        started = time.perf_counter()
        try:
            self._generate(batch)
            self._finish(batch)
            log.info(
                "batch %d done in %.2f s: %d new tokens, %s",
                self.batches,
                time.perf_counter() - started,
                sum(len(job.ids) for job in batch),
                ", ".join(job.finish or "length" for job in batch),
            )
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if len(batch) > 1:  # the estimate was short: each row again in a batch of its own
                log.warning("out of GPU memory in a batch of %d rows; retrying them one at a time", len(batch))
                for job in batch:
                    job.ids, job.finish, job.solo = [], None, True
                self.pending[:0] = batch
                return
            job = batch[0]
            job.post(
                "error",
                ApiError(
                    400,
                    f"out of GPU memory for {job.prompt_tokens} prompt tokens + max_tokens="
                    f"{job.max_new_tokens} — lower max_tokens or shorten the messages",
                    "max_tokens",
                    "insufficient_memory",
                ),
            )
        except Exception as err:  # noqa: BLE001 - a bug: the requests get a 500, the server goes on
            log.exception("generation failed")
            for job in batch:
                job.post(
                    "error",
                    ApiError(500, f"generation failed: {type(err).__name__}: {err}", None, None, "server_error"),
                )

    def _finish(self, batch: list[Job]) -> None:
        for job in batch:
            if self.stopping and job.finish is None:  # cut short by the stop: not a complete reply
                job.post("error", shutting_down())
                continue
            delta = job.reply.finish(self.tokenizer.decode(job.ids))
            if delta:
                job.post("delta", delta)
            finish = "tool_calls" if job.reply.tool_call else job.finish or "length"
            job.post(
                "done",
                {
                    "content": None if job.reply.tool_call else job.reply.shown,
                    "tool_call": job.reply.tool_call,
                    "finish_reason": finish,
                    "prompt_tokens": job.prompt_tokens,
                    "completion_tokens": len(job.ids),
                },
            )
        self.batches += 1

    def _generate(self, batch: list[Job]) -> None:
        model, tok = self.model, self.tokenizer
        vision = getattr(model.config, "vision_config", None)
        device = model.get_input_embeddings().weight.device
        inputs = prompt_batch(
            [(job.request.ids, job.request.image) for job in batch],
            tok.pad_token_id,
            vision["image_size"] if vision else None,
            device,
        )
        settings, seed = batch[0].request.settings, batch[0].request.seed
        new_tokens = max(job.max_new_tokens for job in batch)
        log.info(
            "batch %d: %d rows, prompts of %s tokens, up to %d new tokens",
            self.batches + 1,
            len(batch),
            "/".join(str(job.prompt_tokens) for job in batch),
            new_tokens,
        )
        if seed is not None:
            import transformers

            transformers.set_seed(seed)  # as mode=infer seeds: the same seed gives the same sample
        stop_ids = list(tok.stop_token_ids)
        with torch.no_grad(), preallocated_kv_cache(model, new_tokens):
            model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                eos_token_id=stop_ids,
                pad_token_id=tok.pad_token_id,
                use_cache=True,
                streamer=RowStreamer(batch, tok, set(stop_ids)),
                stopping_criteria=StoppingCriteriaList([RowsDone(batch, self)]),
                **generation_kwargs(settings),
            )
