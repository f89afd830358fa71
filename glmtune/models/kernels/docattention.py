"""Attention of packed rows, one document at a time: no [seq, seq] tensor at any length.

A packed row (data/packing.py) lays its examples end to end, each a contiguous span of positions with its own
seq id (pads, -1, at the end). The dense path (masks.document_mask) builds a block-diagonal causal
boolean mask [B, 1, S, S] and SDPA turns it into an additive bias of the compute dtype that backward keeps:
S^2 x (1 + 2) bytes per row in bf16, 48 GiB at 128K positions. The segments path runs plain causal SDPA
(is_causal=True, no mask) on each span's slice of q, k and v and joins the outputs, so a query sees exactly the
earlier keys of its own document, as with the mask, and the largest attention problem is one document's.

The spans are read once per forward (`document_spans`, from the seq ids: one device-to-host copy of a [B, S]
integer tensor) and passed to every layer as its `mask`, as a BlockMask is for FlexAttention. Under sequence
parallelism attention sees the whole gathered row for its share of the heads (ulysses.py), so the spans
of the gathered seq ids are the spans it needs.

`auto` (train.packed_attention, train/compile.py) keeps the dense mask up to DENSE_MASK_MAX positions a row,
where it costs little and is one kernel call a layer, and goes per document above; `packed_path` is that rule
(models/kernels/attnpath.py), read by the model on every forward and by the planner (plan/packrows.py) to name the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The rule (models/kernels/attnpath.py) is read by mode=plan without this module's torch.compiler; named here for the model
# code and tests that import it from here. Absolute: this module may move into a subfolder of models/.
from .attnpath import DENSE_MASK_MAX, PATHS, packed_path  # noqa: F401


@dataclass(frozen=True)
class DocumentSpans:
    """Each row's documents as (start, end) position spans that tile the row, pad tail included."""

    rows: tuple[tuple[tuple[int, int], ...], ...]
    length: int  # positions per row

    @property
    def largest(self) -> int:
        """The longest span: the largest attention problem this path runs (positions)."""
        return max(end - start for row in self.rows for start, end in row)


def document_spans(seq_ids: torch.Tensor) -> DocumentSpans:
    """The spans of seq ids [B, S] (data/packing.py: -1 = pad). Each document must be one contiguous span, as
    packing lays them; a document split in two would lose its earlier half's keys, so it is refused."""
    ids = seq_ids.detach().to("cpu")
    b, s = ids.shape
    starts = torch.ones(b, s, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rows = []
    for row_ids, row_starts in zip(ids, starts):
        cuts = row_starts.nonzero().flatten().tolist() + [s]
        spans = tuple(zip(cuts[:-1], cuts[1:]))
        docs = [int(row_ids[start]) for start, _ in spans if row_ids[start] >= 0]
        if len(docs) != len(set(docs)):
            raise ValueError(
                f"packed row {len(rows)}: a seq id occurs in two separate spans ({docs}); "
                "each document must be contiguous (data/packing.py)"
            )
        rows.append(spans)
    return DocumentSpans(tuple(rows), s)


# Outside torch.compile's graph (train.compile): traced, the spans' Python ints became guards and each new layout
# of documents compiled the block again (6 layouts, 6 graphs, tiny GLM-4 with compiled blocks); left out, the
# block compiles around this call once (10 layouts, 4 graphs).
@torch.compiler.disable
def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal SDPA per document span. q, k, v [B, heads, S, head_dim] (k, v already expanded to the query heads,
    as the dense path does, so both run the same kernels on the same numbers); returns [B, heads, S, head_dim].
    Pad spans attend among themselves, as under the dense mask; their outputs feed no real token."""
    if spans.length != q.shape[2] or len(spans.rows) != q.shape[0]:
        raise ValueError(
            f"document spans of {len(spans.rows)} rows x {spans.length} positions for attention over "
            f"{q.shape[0]} rows x {q.shape[2]} positions"
        )
    out = []
    # split, not slicing: a slice's backward writes its gradient into a zero tensor of the whole input, once per
    # document (k documents: k row-sized tensors per layer and q/k/v); split's backward is one cat of them all.
    for row, q_row, k_row, v_row in zip(spans.rows, q.split(1), k.split(1), v.split(1)):
        sizes = [end - start for start, end in row]
        parts = [
            F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=True, dropout_p=dropout_p)
            for q_doc, k_doc, v_doc in zip(
                q_row.split(sizes, dim=2), k_row.split(sizes, dim=2), v_row.split(sizes, dim=2)
            )
        ]
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return out[0] if len(out) == 1 else torch.cat(out, dim=0)
