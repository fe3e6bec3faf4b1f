"""Rank functions that run the real pretrain() entry point in-process (spawned by run_distributed)."""


def run_pretrain(rank, world_size, argv):
    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training import pretrain

    result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                      pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                      pretrain_gpt_moe.forward_step, argv=argv)
    return result["history"]

