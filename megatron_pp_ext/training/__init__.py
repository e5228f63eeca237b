"""The training layer: a training run's job, between the Megatron adapter (``megatron/``, the
model, optimizer, checkpoints and the schedule hook) and the command (``commands/train.py``,
flags and launch). It imports the adapter, the runtime and the schedule; none of them, and no
command, is imported back, and no command is imported here.

Laid out in levels, as torchtitan lays out its trainer (train -> train_step ->
forward_backward_step):

* ``worker.py``: a rank's process (:func:`worker.worker`) and :func:`worker.train_loop`;
* ``job.py``: :class:`job.TrainJob`, the iterations (``run``), one iteration (``train_step``), one
  global batch through the runtime's schedule (``forward_backward``), validation, checkpoints;
* ``optimizer_steps.py``: the optimizer and when its step is checked (post-validation);
* ``model.py``, ``data.py``: this rank's chunks in DDP, and its batch iterators;
* ``metrics.py``: log lines, the progress bar, ``--metrics``, TensorBoard, the per-rank report;
* ``settings.py``, ``checks.py``: what the run is asked to do, and the checks before it starts.

This ``__init__`` re-exports nothing, so the command imports ``settings`` (plain data, no torch)
for its flags without loading torch and megatron-core; the rest is imported when a run starts.
"""
