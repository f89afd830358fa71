"""serve.* values, checked for every mode (a typo in a YAML file shows at once) as part of validate.parse_config;
what needs the network or the extra (a host's addresses, binding the port) is serve/port.py's, at mode=serve."""

from __future__ import annotations

import importlib.util
import re

from .schema import RunConfig


def serve_problems(cfg: RunConfig) -> list[str]:
    """serve.*: checked for every mode (a typo in a YAML file shows at once); the extra only for mode=serve."""
    serve, problems = cfg.serve, []
    if not 0 <= serve.port <= 65535:
        problems.append(f"serve.port must be in 0..65535 (0 = any free port), got {serve.port}")
    if not serve.host.strip():
        problems.append("serve.host must name an interface: 127.0.0.1 (this machine only) or 0.0.0.0 (every network)")
    if serve.api_key is not None and not serve.api_key.strip():
        problems.append("serve.api_key is empty: give a key, or leave it null for no authentication")
    if serve.model_name is not None and not serve.model_name.strip():
        problems.append("serve.model_name is empty: give a name, or leave it null for the model folder's name")
    if not 0 < serve.max_body_mib <= 1024:
        problems.append(f"serve.max_body_mib must be in 1..1024 (MiB), got {serve.max_body_mib}")
    if not 0 <= serve.stop_grace_s <= 3600:
        problems.append(f"serve.stop_grace_s must be in 0..3600 (seconds), got {serve.stop_grace_s}")
    for origin in serve.allow_origins:
        if not re.fullmatch(r"https?://[^/\s*]+", origin):
            problems.append(
                f"serve.allow_origins has {origin!r}: list each web page origin as scheme://host[:port] "
                "(e.g. https://app.example), without a path; no wildcard"
            )
    for host in serve.allow_hosts:
        if not re.fullmatch(r"[^/\s:*]+|\[[0-9a-fA-F:.]+\]", host):
            problems.append(
                f"serve.allow_hosts has {host!r}: give host names only (api.example.com), without "
                "scheme, port or wildcard"
            )
    if cfg.mode == "serve" and not all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn")):
        problems.append('mode=serve needs starlette and uvicorn: pip install "glmtune[serve]"')
    return problems
