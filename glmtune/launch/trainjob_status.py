"""A TrainJob's progress for Kubeflow Trainer (v2.2+, feature gate TrainJobStatus): status.trainerStatus.

Inside a TrainJob the controller gives every pod KUBEFLOW_TRAINER_SERVER_URL (the TrainJob's status endpoint),
KUBEFLOW_TRAINER_SERVER_TOKEN (the path of a projected service-account JWT, which the kubelet rotates: read again at
every post) and KUBEFLOW_TRAINER_SERVER_CA_CERT (the path of the CA that signed the endpoint's certificate). Rank 0
then POSTs {"trainerStatus": {progressPercentage, estimatedRemainingSeconds, metrics: [{name, value}],
lastUpdatedTime}} (the SDK's TrainerV1alpha1UpdateTrainJobStatusRequest) with `Authorization: Bearer <token>`:
when training begins, after optimizer steps at most once every INTERVAL_S (the controller's rate), and at the end.
transformers >= 4.57 registers such a callback itself; 4.40 has none, so this one is glmtune's.

Reporting never stops or slows training: each post runs in a background thread with a TIMEOUT_S limit, a step that
comes while one is in flight skips its turn, and the first failure is one warning (the later ones go to rank0.log).
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.request
from datetime import datetime, timezone

from transformers import TrainerCallback

from .signals import STOP

log = logging.getLogger(__name__)

URL, TOKEN, CA = "KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_TOKEN", "KUBEFLOW_TRAINER_SERVER_CA_CERT"
INTERVAL_S = 5.0  # the controller asks for at most one update per 5 s per TrainJob
TIMEOUT_S = 5.0


def status_callbacks() -> list:
    """[TrainJobStatus()] inside a TrainJob whose controller takes progress, else []."""
    return [TrainJobStatus(os.environ[URL], os.environ.get(TOKEN), os.environ.get(CA))] if os.environ.get(URL) else []


class StatusPoster:
    """POSTs to the status endpoint, one request at a time, never more often than INTERVAL_S."""

    def __init__(self, url: str, token_file: str | None, ca_file: str | None):
        self.url, self.token_file, self.failed = url, token_file, False
        self.last = -math.inf  # monotonic time of the last request's start
        self.thread: threading.Thread | None = None
        context = None
        if url.startswith("https:"):
            try:
                context = ssl.create_default_context(cafile=ca_file or None)
            except (OSError, ssl.SSLError) as err:
                self._failure(f"cannot read the CA {ca_file}: {err}")
        # The controller is inside the cluster: no proxy from the environment applies to it.
        self.opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )

    def ready(self) -> bool:
        return time.monotonic() - self.last >= INTERVAL_S and not (self.thread and self.thread.is_alive())

    def post(self, status: dict) -> None:
        """Send in the background (call only when ready())."""
        self.last = time.monotonic()
        self.thread = threading.Thread(target=self._send, args=(status,), name="trainjob-status", daemon=True)
        self.thread.start()

    def post_last(self, status: dict) -> None:
        """The final status: after the one in flight and the interval (at most ~2 x 5 s), then waited for."""
        if self.thread is not None:
            self.thread.join(TIMEOUT_S + 1)
        time.sleep(max(0.0, self.last + INTERVAL_S - time.monotonic()))
        if self.ready():
            self.post(status)
            self.thread.join(TIMEOUT_S + 1)

    def _send(self, status: dict) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            if self.token_file:
                with open(self.token_file) as f:
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            request = urllib.request.Request(
                self.url, data=json.dumps({"trainerStatus": status}).encode(), headers=headers, method="POST"
            )
            with self.opener.open(request, timeout=TIMEOUT_S) as response:
                response.read()
        except Exception as err:  # noqa: BLE001 - any failure of the report is the report's, never training's
            self._failure(f"{type(err).__name__}: {err}")

    def _failure(self, what: str) -> None:
        if not self.failed:
            log.warning(
                "cannot report progress to Kubeflow Trainer (%s): %s — training goes on; later failures are "
                "logged to this rank's log only",
                self.url,
                what,
            )
        else:
            log.info("progress report to %s failed: %s", self.url, what)
        self.failed = True


class TrainJobStatus(TrainerCallback):
    """Rank 0's progress, ETA and latest logged metrics, posted through a StatusPoster."""

    def __init__(self, url: str, token_file: str | None, ca_file: str | None):
        self.poster = StatusPoster(url, token_file, ca_file)
        self.metrics: dict[str, float] = {}
        self.started, self.first_step = 0.0, 0

    def status(self, state, done: bool = False) -> dict:
        step, total = state.global_step, state.max_steps
        status = {"lastUpdatedTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        if total > 0:
            status["progressPercentage"] = min(100, 100 * step // total)
            ran = step - self.first_step  # steps of this launch: a resume's rate is its own
            if done and step >= total:
                status["estimatedRemainingSeconds"] = 0
            elif ran > 0:
                status["estimatedRemainingSeconds"] = round((time.monotonic() - self.started) / ran * (total - step))
        metrics = {**self.metrics, "step": step, "total_steps": total}
        if state.epoch is not None:
            metrics["epoch"] = round(state.epoch, 4)
        status["metrics"] = [
            {"name": name, "value": f"{value:.6g}" if isinstance(value, float) else str(value)}
            for name, value in metrics.items()
        ]
        return status

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.first_step = time.monotonic(), state.global_step
        if state.is_world_process_zero and self.poster.ready():
            self.poster.post(self.status(state))

    def on_log(self, args, state, control, logs=None, **kwargs):
        # loss, grad norm, learning rate, eval metrics: numbers only (the closing record's totals are not progress)
        self.metrics.update(
            {
                k: v
                for k, v in (logs or {}).items()
                if isinstance(v, (int, float))
                and not isinstance(v, bool)
                and not k.endswith(("_runtime", "per_second", "total_flos"))
            }
        )

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.poster.ready():
            self.poster.post(self.status(state))

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if STOP.received is None:
            self.poster.post_last(self.status(state, done=True))
        elif self.poster.ready():  # a stop signal: its grace period is for the checkpoint, not for a wait here
            self.poster.post(self.status(state))
