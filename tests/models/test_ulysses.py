"""Ulysses sequence parallelism in the GLM attention (models/ulysses.py, issue 30): the same rows sharded over 2
and 4 processes give the logits, token loss and gradients of one process holding the whole rows.

tests/models/sp_worker.py runs under torchrun (4 ranks, gloo on CPU): GLM-4 and ChatGLM3 tiny models in fp32, with 4
query heads (one per rank at SP 4: the 2 KV groups are replicated) and 8; plain rows and packed rows whose
documents cross every shard boundary; with reentrant and non-reentrant checkpointing; GLM-4V with three images
merged into the whole rows before they are cut (plain and packed rows).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import BIN

from glmtune.models.kernels.ulysses import SequenceGroup, shard

WORKER = Path(__file__).with_name("sp_worker.py")


@pytest.mark.slow
def test_sequence_parallel_matches_one_process(tmp_path, repo):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4", str(WORKER), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())["results"]
        assert len(results) == 28
        for case, diff in results.items():
            assert diff["missing"] == [], case
            assert diff["logits"] <= 1e-5 and diff["loss"] <= 1e-5 and diff["grads"] <= 1e-5, (rank, case, diff)


def test_heads_must_split_over_the_group():
    assert SequenceGroup(None, 4, 0).check_heads(32, 2) is None  # GLM-4: 8 heads and 1 replicated group a rank
    assert SequenceGroup(None, 2, 1).check_heads(32, 2) is None
    assert "KV groups" in SequenceGroup(None, 3, 0).check_heads(33, 2)
    assert "attention heads" in SequenceGroup(None, 8, 0).check_heads(4, 2)


def test_shard_takes_the_ranks_contiguous_part():
    import torch

    row = torch.arange(12).view(1, 12)
    assert shard(row, SequenceGroup(None, 4, 2)).tolist() == [[6, 7, 8]]
    with pytest.raises(ValueError, match="not a multiple"):
        shard(torch.arange(10).view(1, 10), SequenceGroup(None, 4, 0))
