"""A quiet start: megatron-core's known import-time warnings kept off a user's screen.

Importing megatron-core on a machine without Transformer Engine or Apex prints the same
fallback warnings in every process (58 lines on stderr before the first step of the README's
main job, four ranks and the launcher). They say nothing a user can act on, so the command line
(``cli.main``) filters them in its own process and, through ``MEGATRON_PP_EXT_QUIET=1``, in the
processes it starts (``megatron_pp_ext/__init__.py`` installs the filter at import, before any
megatron-core module loads). ``--verbose`` shows them again. Other warnings pass.
"""

from __future__ import annotations

import warnings

QUIET_VARIABLE = "MEGATRON_PP_EXT_QUIET"

# the start of each known message (megatron-core 0.16)
KNOWN = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",  # transformer_config: cuda_graph_scope, which we do not set
    r"The following imports from `dynamic_context.py` will be removed",
)


def install() -> None:
    """Ignore the known warnings in this process."""
    for message in KNOWN:
        warnings.filterwarnings("ignore", message=message)
