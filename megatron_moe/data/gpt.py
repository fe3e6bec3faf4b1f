"""GPT datasets over megatron-core's indexed datasets (blending, splits, index cache)."""

from __future__ import annotations

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list


def common_dataset_kwargs(args, tokenizer) -> dict:
    """The BlendedMegatronDatasetConfig fields every model's dataset takes from Megatron's flags."""
    return dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        blend_per_split=[get_blend_from_list(args.train_data_path),
                         get_blend_from_list(args.valid_data_path),
                         get_blend_from_list(args.test_data_path)],
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        mid_level_dataset_surplus=0.005,
    )


def gpt_dataset_config(args, tokenizer) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        **common_dataset_kwargs(args, tokenizer),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # Megatron-LM's default: each sample carries its [1, s, s] mask (True = masked), which the
        # attention applies; --no-create-attention-mask-in-dataloader: none, the attention's own
        # causal mask (the flash-eligible SDPA path, no mask copies)
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_num_samples(args):
    """Samples each split must provide (Megatron's formula, so index caches are shared with it)."""
    train = getattr(args, "train_samples", None) or args.train_iters * args.global_batch_size
    if getattr(args, "skip_train", False):   # --skip-train: one evaluation
        evals = args.eval_iters
    else:
        evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    eval_batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    return [train, evals * eval_batch, args.eval_iters * eval_batch]


def check_split_sizes(config, split_flag: str) -> None:
    """A --split share that rounds to zero documents makes megatron-core's builder fail (BERT: an
    IndexError) or spin forever (GPT: it adds empty epochs until it has enough tokens), e.g.
    Megatron's `--split 99990,8,2` on a small corpus; refuse it by name before building."""
    if config.blend is None:
        return
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in config.blend[0]:
        documents = IndexedDataset(prefix).document_indices.shape[0] - 1
        for name, bounds in zip(("train", "validation", "test"), config.split_matrix):
            if bounds is not None and round(bounds[1] * documents) <= round(bounds[0] * documents):
                raise ValueError(
                    f"--split {split_flag}: the {name} split of {prefix} ({documents} documents) "
                    f"has no document; give it a larger share, or 0 to drop that split")


def build_gpt_datasets(args, tokenizer, num_samples=None):
    config = gpt_dataset_config(args, tokenizer)
    if args.mock_data:
        config.blend = None
        config.blend_per_split = None
    check_split_sizes(config, args.split)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, num_samples or train_valid_test_num_samples(args), lambda: True, config)
    return builder.build()

