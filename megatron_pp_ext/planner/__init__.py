"""The planner: the best parallel layout and schedule for a model, a sequence length and a cluster.

A layer above the schedule core (``megatron_pp_ext.schedule``): it enumerates Megatron layouts
(TP, CP, PP, DP) and pipeline choices (schedule, chunks, slices, offload, recompute), turns a
device profile (``devices.py``) into per-op durations that include the tensor- and
context-parallel collectives (``costs.py``), replays each candidate's schedule with the real
simulator, adds what the simulator leaves out (data-parallel gradient sync, optimizer step,
communication buffers: ``step.py``), and ranks the plans (``search.py``). Pure Python: torch is
imported only by ``calibrate.py``, inside the function that measures a GPU.
"""
