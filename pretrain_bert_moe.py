#!/usr/bin/env python
"""Pretrain a BERT Mixture-of-Experts model (Megatron-LM's pretrain_bert.py, for MoE).

    torchrun --nproc_per_node 2 pretrain_bert_moe.py --num-layers 4 ... --num-experts 8 \
        --expert-model-parallel-size 2 --data-path my-corpus_text_sentence \
        --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt ...

The model is megatron-core's ``BertModel`` (padding attention mask, token types, masked-LM head,
optional sentence-order binary head) whose transformer layers come from the same MoE layer spec
as GPT (``megatron_moe.models.builder.gpt_layer_spec``: dispatcher, router and balancer hooks included),
with the attention mask switched to padding. Data: ``megatron_moe.data.bert`` over sentence-level
indexed datasets (``tools/preprocess_data.py --split-sentences``).
"""

from functools import partial

import torch
import torch.nn.functional as F

from megatron_moe.compat import quiet_known_warnings

quiet_known_warnings()
from megatron.core.enums import ModelType
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.enums import AttnMaskType

from megatron_moe.data.bert import add_bert_arguments, build_bert_datasets, validate_bert_args
from megatron_moe.models.embedding import partition_word_embeddings
from megatron_moe.models.embedding import validate_args as validate_embedding_args
from megatron_moe.runtime.global_vars import get_args, get_tokenizer
from megatron_moe.models.builder import common_model_kwargs, gpt_layer_spec, transformer_config_from_args
from megatron_moe.training.loop import pretrain
from megatron_moe.training.result_validation import record_loss


class BertMoEModel(BertModel):
    """BertModel whose encoder takes a transformer *block* spec (per-layer dense/MoE specs).

    megatron-core's BertModel inspects one layer spec to pick the attention-mask layout; with a
    block spec we let it inspect the first layer and give every layer the mask type it chose.
    """

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        block = self.transformer_layer_spec
        layers = getattr(block, "layer_specs", None)
        if _own_local_core_attention(layers[0] if layers else block):
            return "b1ss"
        if not layers:
            return super()._sanity_check_attention_and_get_attn_mask_dimension()
        self.transformer_layer_spec = layers[0]
        try:
            dims = super()._sanity_check_attention_and_get_attn_mask_dimension()
        finally:
            self.transformer_layer_spec = block
        mask_type = layers[0].submodules.self_attention.params["attn_mask_type"]
        for spec in layers:
            spec.submodules.self_attention.params["attn_mask_type"] = mask_type
        return dims


def _own_local_core_attention(layer_spec) -> bool:
    """True when the layer's core attention is one of models/attention.py's local ones (SDPA
    under --attention-backend flash): they take megatron-core's local [b, 1, s, s] mask, but
    BertModel recognises only megatron-core's own class and would ask Transformer Engine."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    core = layer_spec.submodules.self_attention.submodules.core_attention
    return isinstance(core, type) and issubclass(core, DotProductAttention) \
        and core is not DotProductAttention


def bert_layer_spec(args, config):
    """GPT's MoE block spec with bidirectional (padding-masked) self-attention."""
    import copy

    spec = copy.deepcopy(gpt_layer_spec(args, config))
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attention = layer.submodules.self_attention
        attention.params = dict(attention.params or {}, attn_mask_type=AttnMaskType.padding)
    return spec


def bert_model_provider(args, pre_process=True, post_process=True, vp_stage=None) -> BertModel:
    config = transformer_config_from_args(args)
    model = BertMoEModel(
        num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=bert_layer_spec(args, config),
        add_binary_head=args.bert_binary_head,
        **common_model_kwargs(args, config, pre_process, post_process, vp_stage),
    )
    return partition_word_embeddings(model, args)


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    return bert_model_provider(get_args(), pre_process, post_process, vp_stage)


def _validate_bert_args(args):
    validate_bert_args(args)
    validate_embedding_args(args)


def extra_args_provider(parser):
    """BERT flags, checked by arguments.parse_args before any process group (after the flags a
    checkpoint supplies with --use-checkpoint-args)."""
    add_bert_arguments(parser)
    parser.prog = "pretrain_bert_moe.py"
    parser.validate_extra_args = _validate_bert_args
    return parser


_BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


def get_batch(data_iterator):
    """This rank's micro-batch. Every pipeline stage reads it: the encoder needs the padding mask
    on each stage, not only the embedding and loss stages."""
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
    tokens, types, labels, sentence_order, loss_mask, padding_mask = (
        torch.as_tensor(batch[key]).long().to(device, non_blocking=True) for key in _BATCH_KEYS)
    return tokens, types, sentence_order, loss_mask, labels, padding_mask


def loss_func(loss_mask, sentence_order, output_tensor):
    """Masked-LM loss over the masked positions (+ sentence-order loss with the binary head)."""
    lm_loss_, sop_logits = output_tensor
    lm_loss_ = lm_loss_.float()
    loss_mask = loss_mask.float()
    lm_loss = torch.sum(lm_loss_.view(-1) * loss_mask.reshape(-1)) / loss_mask.sum().clamp(min=1.0)
    if sop_logits is None:
        record_loss(lm_loss)   # validated after the forward-backward (--rerun-mode)
        return lm_loss, {"lm loss": lm_loss.detach().clone()}
    sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1),
                               ignore_index=-1)
    record_loss(lm_loss + sop_loss)
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach().clone(),
                                "sop loss": sop_loss.detach().clone()}


def forward_step(data_iterator, model):
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    if not get_args().bert_binary_head:
        types = None
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    return build_bert_datasets(get_args(), get_tokenizer(), train_val_test_num_samples)


train_valid_test_datasets_provider.is_distributed = True


def main(argv=None):
    return pretrain(train_valid_test_datasets_provider, model_provider,
                    ModelType.encoder_or_decoder, forward_step,
                    extra_args_provider=extra_args_provider,
                    args_defaults={"tokenizer_type": "BertWordPieceLowerCase"}, argv=argv)


if __name__ == "__main__":
    main()
