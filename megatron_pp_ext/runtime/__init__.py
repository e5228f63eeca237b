"""The runtime: executes one rank's lowered schedule on Megatron model chunks."""
