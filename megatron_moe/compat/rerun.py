"""megatron-core's rerun state machine across releases.

megatron-core 0.16's ``_maybe_report_stats`` (--rerun-mode report_stats) prints each validation
call's ``caller.filename`` and ``caller.lineno``, fields its ``Caller`` lost when the call site
became the validation's message: the statistics report raised AttributeError on rank 0. Newer
releases print the message; here the two fields answer the same text (``From validation call
'<message>', line -``), so the report runs on 0.16 too.
"""

from __future__ import annotations

import inspect


def fix_report_stats_caller():
    from megatron.core.rerun_state_machine import Caller, RerunStateMachine

    if "filename" in Caller._fields or hasattr(Caller, "filename"):
        return
    if "caller.filename" not in inspect.getsource(RerunStateMachine._maybe_report_stats):
        return   # the release prints the message itself
    Caller.filename = property(lambda caller: f"validation call '{caller.message}'")
    Caller.lineno = property(lambda caller: "-")
