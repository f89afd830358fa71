"""Serve: `mode=serve`, an OpenAI-compatible HTTP server for base + adapter. The request's JSON to GLM messages and
sampling (`protocol.py`), GLM-4's reply to content deltas or a tool call (`reply.py`), batched generation of
concurrent requests (`engine.py`), the routes and OpenAI's answer and error shapes (`app.py`), and the process:
port, model loading, start line, clean stop (`server.py`).

May import: glmtune.config, launch, rundir, models, data, plan, infer. Imported by run/modes.py only.
"""
