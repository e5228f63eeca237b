"""megatron-core side of megatron_pp_ext: model chunks, layer specs, attention."""
