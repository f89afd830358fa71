"""Serve: `mode=serve`, an OpenAI-compatible HTTP server for base + adapter. What a request must be before any route
reads it: Host, Origin, Content-Type (`guard.py`); the request's JSON to GLM messages and sampling (`protocol.py`),
GLM-4's reply to content deltas or a tool call (`reply.py`), batched generation of concurrent requests (`engine.py`;
a request in flight and its row of a batch in `jobs.py`), the routes, the bounded body and OpenAI's answer and error
shapes (`app.py`), the port held before anything loads and the key a network needs (`port.py`), and the process:
model loading, start line, clean stop (`server.py`). The server reads and writes no file a request names.

May import: glmtune.config, launch, rundir, models, data, plan, infer. Imported by the modes (glmtune/modes/) only.
"""
