"""A --split share that rounds to zero documents is refused by name (megatron-core's builder would
spin forever for GPT, raise an IndexError for BERT), e.g. Megatron's `--split 99990,8,2`."""

from __future__ import annotations

import types

import numpy
import pytest
import torch

from megatron_moe.runtime.local_ranks import free_port
from tests.test_training import TINY, cli


def _corpus(tmp_path, documents=40):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    rng = numpy.random.default_rng(0)
    for _ in range(documents):
        builder.add_document(torch.tensor(rng.integers(1, 255, size=50)), [50])
    builder.finalize(prefix + ".idx")
    return prefix


def _config(prefix, split):
    from megatron_moe.data.gpt import gpt_dataset_config

    args = types.SimpleNamespace(
        seed=1, seq_length=32, data_path=[prefix], train_data_path=None, valid_data_path=None,
        test_data_path=None, split=split, data_cache_path=None, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask_in_dataloader=True)
    return gpt_dataset_config(args, tokenizer=types.SimpleNamespace(vocab_size=256))


@pytest.mark.parametrize("split, refused", [("99990,8,2", "validation"), ("95,5,0", None),
                                            ("97,2,1", "test"), ("1,500,500", "train")])
def test_check_split_sizes(tmp_path, split, refused):
    from megatron_moe.data.gpt import check_split_sizes

    prefix = _corpus(tmp_path)
    if refused is None:
        check_split_sizes(_config(prefix, split), split)  # 38/2/0 documents: accepted
        return
    with pytest.raises(ValueError) as err:
        check_split_sizes(_config(prefix, split), split)
    assert f"--split {split}: the {refused} split of {prefix} (40 documents) has no document" \
        in str(err.value)


def test_pretrain_refuses_empty_split_instead_of_hanging(tmp_path):
    prefix = _corpus(tmp_path)
    args = [a for a in TINY if a != "--mock-data"]
    out = cli(args + ["--train-iters", "1", "--data-path", prefix, "--split", "99990,8,2"],
              env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}, timeout=120)
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert ("--split 99990,8,2: the validation split of " + prefix) in said, said
    assert "Traceback" not in said
