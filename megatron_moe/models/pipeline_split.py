"""Which decoder layers each pipeline stage holds, as megatron-core builds them.

Megatron's ways to split the layers over pipeline stages: an even split (the default),
--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (uneven first / last
stage), --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split (the
embedding / loss counted as one layer of the first / last stage) and
--pipeline-model-parallel-layout. megatron-core's TransformerBlock sizes and numbers its layers
with ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` (or the layout's own
counts); every other place here that needs a stage's layers (parse-time checks, the memory
report, ring memory) asks this module, which asks those same functions with an explicit
pipeline rank, so nothing assumes an even split.
"""

from __future__ import annotations

from typing import List

# Megatron-LM's flag for each TransformerConfig field of the split (the two renamed ones:
# Megatron-LM's core_transformer_config_from_args maps them)
SPLIT_FIELDS = {
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split": "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split": "account_for_loss_in_pipeline_split",
}
SPLIT_FLAGS = {dest: "--" + dest.replace("_", "-") for dest in SPLIT_FIELDS}


def split_config(args):
    """A TransformerConfig carrying only the pipeline split of ``args`` (megatron-core's own
    __post_init__ checks the split; its layer-counting functions read nothing else)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = {field: getattr(args, dest, None) for dest, field in SPLIT_FIELDS.items()}
    kwargs["account_for_embedding_in_pipeline_split"] = bool(
        kwargs["account_for_embedding_in_pipeline_split"])
    kwargs["account_for_loss_in_pipeline_split"] = bool(kwargs["account_for_loss_in_pipeline_split"])
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=8, num_attention_heads=1,   # placeholders
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(
            args, "virtual_pipeline_model_parallel_size", None),
        pipeline_dtype=torch.float32, **kwargs)


def stage_layers(args, pp_rank: int) -> List[range]:
    """0-based global decoder-layer indices on pipeline rank ``pp_rank``: one range per model
    chunk (virtual stage), in megatron-core's order."""
    pp = args.pipeline_model_parallel_size
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout)

        parsed = PipelineParallelLayerLayout.from_str(layout, pp).layout  # [pp rank][virtual stage]
        mine, offset = [], 0
        for vp in range(len(parsed[0])):        # megatron-core's order: virtual stage, then rank
            for rank in range(pp):
                n = parsed[rank][vp].count(LayerType.decoder)
                if rank == pp_rank:
                    mine.append(range(offset, offset + n))
                offset += n
        return mine
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = split_config(args)
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in (range(vpp) if vpp else [None]):
        n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        chunks.append(range(offset, offset + n))
    return chunks


def layers_per_stage(args) -> List[int]:
    """Decoder layers on each pipeline rank (all its model chunks)."""
    return [sum(len(chunk) for chunk in stage_layers(args, rank))
            for rank in range(args.pipeline_model_parallel_size)]


def validate_split_args(args):
    """Megatron-LM's and megatron-core's rules for the split, at parse time: ValueError, one line
    naming the flag. Needs ``args.num_layers`` and ``args.virtual_pipeline_model_parallel_size``
    resolved (arguments._resolve_virtual_pipeline)."""
    pp = args.pipeline_model_parallel_size
    given = [flag for dest, flag in SPLIT_FLAGS.items() if getattr(args, dest, None)]
    uneven = [SPLIT_FLAGS[d] for d in ("decoder_first_pipeline_num_layers",
                                        "decoder_last_pipeline_num_layers")
              if getattr(args, d, None) is not None]
    accounted = [SPLIT_FLAGS[d] for d in ("account_for_embedding_in_pipeline_split",
                                           "account_for_loss_in_pipeline_split")
                 if getattr(args, d, False)]
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        if given:
            raise ValueError(f"{given[0]} cannot be used with --pipeline-model-parallel-layout "
                             f"(the layout places every layer; megatron-core's rule)")
        return
    for flag in uneven:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value <= 0:
            raise ValueError(f"{flag} must be > 0 (got {value})")
    if uneven and accounted:
        raise ValueError(f"{uneven[0]} cannot be used with {accounted[0]} (megatron-core's rule)")
    if not uneven:
        total = args.num_layers + len(accounted)
        if total % pp:
            extra = "".join(f" + 1 ({flag})" for flag in accounted)
            hint = "" if accounted else (" (or set --decoder-first-pipeline-num-layers / "
                                         "--decoder-last-pipeline-num-layers)")
            raise ValueError(f"--num-layers ({args.num_layers}){extra} must be divisible by "
                             f"--pipeline-model-parallel-size ({pp}){hint}")
    if not given:
        return
    try:   # the rest of megatron-core's rules: its config's checks and its layer counting
        layers_per_stage(args)
    except (ValueError, AssertionError) as exc:
        reason = " ".join(str(exc).split())
        raise ValueError(f"{' / '.join(given)} with --num-layers {args.num_layers}, "
                         f"--pipeline-model-parallel-size {pp}: {reason}") from None
