"""Quiet saves: the common state (written by rank 0 only) is identical on every rank.

megatron-core compares every rank's common state dict with rank 0's at each save and warns
"Rank N common state dict differs from rank 0 ... Mismatched keys: args" when they differ: a
per-rank value stored there would be silently replaced by rank 0's on load. The run below saves
twice; the first save must be silent, and a per-rank value slipped into the stored args from the
second save on must be caught (so the capture is shown to work). Other layouts (TP, PP, EP=4, the
distributed optimizer) are checked by the resharding tests, which assert the same silence.
"""

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY, differs, run_pretrain_capture


def test_common_state_identical_on_every_rank(tmp_path):
    argv = TINY + ["--expert-model-parallel-size", "2", "--train-iters", "2", "--save-interval",
                   "1", "--save", str(tmp_path / "ckpt")]
    out = run_distributed(run_pretrain_capture, 2, argv, timeout_s=300,
                          poison_after_first_save=True)
    (_, warnings0, saves0), (_, warnings1, saves1) = out
    assert saves0 == saves1 == [1, 2]
    assert differs(warnings0) == []                 # rank 0 compares with itself: never warns
    assert len(differs(warnings1)) == 1, warnings1  # only the poisoned second save
    assert "Mismatched keys: [(('args',)" in differs(warnings1)[0]
