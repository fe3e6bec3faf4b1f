"""megatron-core's per-layer MoE metric tracker (aux losses, z-loss, our topology_loss).

<= 0.17: a module-level dict, ``moe_utils.get_moe_layer_wise_logging_tracker()``, reported by
    ``moe_utils.track_moe_metrics(...)``.
>= 0.18: ``moe_logging.get_moe_metrics_tracker()`` (a ``MoEMetricsTracker``: ``.metrics`` maps a
    name to an entry with ``.values``; ``.report(...)`` takes track_moe_metrics' keywords). The old
    functions remain as deprecated wrappers, and ``get_moe_layer_wise_logging_tracker()`` now
    returns a fresh dict each call, so removing a name from it does nothing. We use the tracker.
"""

from megatron_moe.compat.versions import mcore_at_least


def _tracker():
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker()


def moe_metric_values() -> dict:
    """{metric name: its live per-layer values tensor} (write to them in place to change them)."""
    if mcore_at_least("0.18"):
        return {name: entry.values for name, entry in _tracker().metrics.items()}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}


def drop_moe_metric(name: str) -> None:
    """Forget a metric entirely (it is created again by the next record)."""
    if mcore_at_least("0.18"):
        _tracker().metrics.pop(name, None)
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().pop(name, None)


def report_moe_metrics(**kwargs):
    """Reduce, log (writer / total_loss_dict) and clear the tracked metrics: megatron-core's
    ``track_moe_metrics`` keywords (loss_scale, iteration, writer, total_loss_dict, ...)."""
    if mcore_at_least("0.18"):
        tracker = _tracker()
        if kwargs.get("force_initialize") and kwargs.get("num_layers") is not None:
            # report() would pre-create missing entries on the device *string* "cpu" when CUDA is
            # absent; create them here as it does with CUDA, on the current device object, so
            # they are the data device's tensors (strict device mode, comm/strict.py, flags the
            # string form as a host buffer bound for an NCCL all-reduce).
            import torch

            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
            size = kwargs["num_layers"] + (kwargs.get("mtp_num_layers") or 0)
            names = kwargs.get("track_names")
            for name in ([names] if isinstance(names, str) else names or []):
                tracker.ensure_initialized(name, size, device=device)
        return tracker.report(**kwargs)
    from megatron.core.transformer.moe.moe_utils import (get_moe_layer_wise_logging_tracker,
                                                         track_moe_metrics)

    if kwargs.get("force_initialize") and kwargs.get("mtp_num_layers"):
        # <= 0.17 pre-creates missing entries with num_layers values, while a router records
        # num_layers + mtp_num_layers: a pipeline stage without MoE layers would then all-reduce
        # a shorter tensor than the MTP stage (gloo hangs, NCCL corrupts). Create them full size.
        import torch

        size = kwargs["num_layers"] + kwargs["mtp_num_layers"]
        tracker = get_moe_layer_wise_logging_tracker()
        names = kwargs.get("track_names")
        for name in ([names] if isinstance(names, str) else names or []):
            if name not in tracker:
                tracker[name] = {"values": torch.zeros(size, device=torch.cuda.current_device()),
                                 "reduce_group": None, "avg_group": None,
                                 "reduce_group_has_dp": False}
    return track_moe_metrics(**kwargs)
