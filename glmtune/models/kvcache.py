"""A KV cache allocated once per generate() call instead of grown by concatenation at every token.

Without it each decode step copies every layer's whole cache into a new, one-token-longer tensor
(torch.cat): O(tokens^2) bytes moved per generation and a stream of ever larger allocations. Inside
`preallocated_kv_cache(model, new_tokens)` the prompt's forward allocates each layer's buffer for prompt +
new_tokens positions and every step writes one position into it (models/kernels/attention.py _store);
the cache handed back to generate() is a view of the filled part, so nothing else changes.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn


@contextmanager
def preallocated_kv_cache(model: nn.Module, new_tokens: int):
    """Within this block a prompt's forward allocates each layer's KV cache once, with room for `new_tokens`
    more, and decoding writes into it. For one generate() call at a time (a branching search that reuses a
    cache for two continuations must not run inside); the buffers are freed on exit."""
    layers = [m for m in model.modules() if hasattr(m, "kv_reserve") and hasattr(m, "_store")]
    for layer in layers:
        layer.kv_reserve = new_tokens
    try:
        yield model
    finally:
        for layer in layers:
            layer.kv_reserve, layer._kv_buffer = 0, None
