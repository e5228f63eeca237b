"""The commands' errors, defined in :mod:`megatron_pp_ext.errors` (the training layer raises them
too, and never imports a command); kept here for the commands and callers that import them so."""

from __future__ import annotations

from ..errors import JobError, UsageError

__all__ = ["JobError", "UsageError"]
