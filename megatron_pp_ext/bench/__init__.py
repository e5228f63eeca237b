"""``megatron-pp-ext bench``: our schedules against torch.distributed.pipelining's, same model and data.

``plan`` decides the rows (which of our schedules run at this p, which torch class pairs with
each), ``our_job`` and ``torch_job`` run one rank's step of each, ``worker`` times them in turns
and gathers the results, ``report`` prints the table. See docs/benchmarks.md for the numbers.
"""
