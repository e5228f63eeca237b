"""The Megatron adapter: model chunks from megatron-core, layer specs, and the schedule hook.

``install(args)`` / ``add_args(parser)`` are importable without torch; the model helpers in
``megatron_pp_ext.megatron.model`` need torch and megatron-core.
"""

from .hook import PipelineOptions, add_args, install, uninstall

__all__ = ["PipelineOptions", "add_args", "install", "uninstall"]
