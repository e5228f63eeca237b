"""megatron_pp_ext: memory-thrifty, bubble-free pipeline schedules for Megatron-core."""

import os as _os

if _os.environ.get("MEGATRON_PP_EXT_QUIET") == "1":  # set by the command line for its processes
    from . import quiet as _quiet

    _quiet.install()
