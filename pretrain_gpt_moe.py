#!/usr/bin/env python
"""Pretrain a GPT Mixture-of-Experts model (Megatron-LM's pretrain_gpt.py, for MoE).

    torchrun --nproc_per_node 2 pretrain_gpt_moe.py --num-layers 4 ... --num-experts 8 \
        --expert-model-parallel-size 2 --data-path my-corpus_text_document ...
"""

from functools import partial

import torch

from megatron_moe.compat import quiet_known_warnings

quiet_known_warnings()
from megatron.core import parallel_state
from megatron.core.enums import ModelType

from megatron_moe.compat.context_parallel import batch_on_this_cp_rank
from megatron_moe.data.gpt import build_gpt_datasets
from megatron_moe.runtime.global_vars import get_args, get_tokenizer
from megatron_moe.models.builder import gpt_model_provider
from megatron_moe.training.loop import pretrain
from megatron_moe.training.result_validation import record_loss


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    return gpt_model_provider(get_args(), pre_process, post_process, vp_stage)


def needs_attention_mask(args) -> bool:
    """Whether the model needs the dataloader's attention mask. Without --reset-attention-mask it is
    Megatron's plain causal mask, which megatron-core's attentions build themselves from None (and
    Transformer Engine's causal attention ignores): not copied to the device, and torch SDPA keeps
    its flash kernel, which an explicit mask rules out (docs/gpu.md)."""
    return bool(args.reset_attention_mask)


# the per-token tensors a context-parallel rank keeps its chunks of (the mask: its query rows)
_CP_SPLIT_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch; middle pipeline stages take their input from the previous stage
    (with virtual stages: this model chunk's place in the pipeline)."""
    stage = {} if vp_stage is None else dict(ignore_virtual=False, vp_stage=vp_stage)
    first = parallel_state.is_pipeline_first_stage(**stage)
    last = parallel_state.is_pipeline_last_stage(**stage)
    if not (first or last):
        return None, None, None, None, None
    batch = next(data_iterator)   # not edited in place: a CUDA graph's static input buffers
    keep_mask = needs_attention_mask(get_args())
    device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
    batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
             for k, v in batch.items() if keep_mask or k != "attention_mask"}
    # --context-parallel-size: this CP rank's two chunks of the sequence (megatron-core's
    # load-balanced split, as Megatron-LM's pretrain_gpt.py); the attention gathers the keys
    batch = batch_on_this_cp_rank(
        {k: batch[k] for k in _CP_SPLIT_KEYS if batch.get(k) is not None})
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask, output_tensor):
    """Mean next-token loss over unmasked tokens (of the whole sequences under context
    parallelism); reported per data-parallel rank.

    --calculate-per-token-loss (Megatron's form): the loss summed over tokens with the token
    count; megatron-core's schedule and finalize_model_grads divide by the global token count."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * loss_mask)
    if get_args().calculate_per_token_loss:
        num_tokens = loss_mask.sum().detach().to(torch.int)
        report = torch.cat([loss_sum.detach().view(1), num_tokens.view(1).float()])
        # Megatron-LM's NaN / Inf / spiky-loss validations of this rank's loss, made after the
        # forward-backward in one host read (megatron_moe/training/result_validation.py)
        record_loss(loss_sum)
        return loss_sum, num_tokens, {"lm loss": report}
    num_tokens = loss_mask.sum()
    if parallel_state.get_context_parallel_world_size() > 1:
        # this CP rank holds 1/cp of each sequence: divide its loss sum by the whole sequences'
        # token count (megatron-core's schedule multiplies the loss by cp and its DDP averages
        # gradients over data x context parallel ranks, so the gradient is the CP=1 run's), and
        # report the whole sequences' mean on every CP rank (the log averages over DP x CP ranks)
        pair = torch.stack([loss_sum.detach(), num_tokens])
        torch.distributed.all_reduce(pair, group=parallel_state.get_context_parallel_group())
        loss = loss_sum / pair[1].clamp(min=1.0)
        report = pair[0] / pair[1].clamp(min=1.0)
    else:
        loss = loss_sum / num_tokens.clamp(min=1.0)
        report = loss.detach().clone()
    record_loss(loss)
    return loss, {"lm loss": report}


def forward_step(data_iterator, model):
    from megatron_moe.models.builder import unwrap

    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, getattr(unwrap(model), "vp_stage", None))
    # loss_mask: megatron-core's Multi-Token Prediction masks its own losses with it
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    return build_gpt_datasets(get_args(), get_tokenizer(), train_val_test_num_samples)


train_valid_test_datasets_provider.is_distributed = True


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, args_defaults={"tokenizer_type": "SentencePieceTokenizer"})
