"""One request in flight (Job), and how a batch reaches each of its requests: every generated token routed to its
row's job (RowStreamer), and each row stopped on its own (RowsDone). The engine (engine.py) runs the batches.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from .protocol import ApiError, ChatRequest
from .reply import ReplyText


@dataclass(eq=False)
class Job:
    """One request in flight. The worker thread fills it and posts events to the request's event loop:
    ("delta", text), then ("done", result dict) or ("error", ApiError)."""

    request: ChatRequest
    max_new_tokens: int
    prompt_tokens: int  # positions the prompt takes, image patches included
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[int] = field(default_factory=list)
    finish: str | None = None  # stop | length | cancelled, once the row is done
    cancelled: bool = False  # the client went away: the row stops at its next token
    solo: bool = False  # run in a batch of its own (a seeded sample, or a retry after running out of memory)

    def __post_init__(self):
        self.reply = ReplyText(self.request.tool_names, self.request.stops)

    def post(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: the server is gone, nobody listens
            pass

    def key(self) -> tuple:
        """Requests with equal keys share a batch (generate() takes one set of sampling settings)."""
        s = self.request.settings
        if self.solo or self.request.seed is not None:
            return ("solo", id(self))
        if not s.do_sample:
            return ("greedy", s.repetition_penalty)
        return ("sample", s.temperature, s.top_p, s.top_k, s.repetition_penalty)


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down: the reply was not finished — send the request again once the server is back",
        None,
        "server_shutdown",
        "server_error",
    )


class RowStreamer(BaseStreamer):
    """Routes each generated token to its row's job; a row is done at a stop id, its max_tokens or a stop string."""

    def __init__(self, jobs: list[Job], tokenizer, stop_ids: set[int]):
        self.jobs, self.tokenizer, self.stop_ids, self.prompt_seen = jobs, tokenizer, stop_ids, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        for job, token in zip(self.jobs, value.reshape(-1).tolist()):
            if job.finish is not None:
                continue
            if token in self.stop_ids:
                job.finish = "stop"
                continue
            job.ids.append(token)
            delta = job.reply.update(self.tokenizer.decode(job.ids))
            if delta:
                job.post("delta", delta)
            if job.reply.stopped:
                job.finish = "stop"
            elif len(job.ids) >= job.max_new_tokens:
                job.finish = "length"
            elif job.cancelled:
                job.finish = "cancelled"

    def end(self) -> None:
        pass


class RowsDone(StoppingCriteria):
    def __init__(self, jobs: list[Job], engine):  # engine: the Engine whose `stopping` ends every row
        self.jobs, self.engine = jobs, engine

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        done = [job.finish is not None or job.cancelled or self.engine.stopping for job in self.jobs]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
