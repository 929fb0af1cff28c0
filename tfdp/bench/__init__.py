"""Step time and peak memory of DP-SGD methods against non-private training.

Run, e.g.::

    python -m tfdp.bench --model=resnet18 --image_size=32 --batch_size=32

By default it compares non-private training with tfdp's default clipping
method ("auto"), XLA off: two children, a line for each as it finishes,
then the table. `--methods=all --jit_compile=both` measures every method
with XLA off and on, each private method also paired with non-private
training in one process.

Every (method, jit_compile) pair runs in its own subprocess, so that the peak
resident set size (`getrusage(RUSAGE_SELF).ru_maxrss`) is that method's own.
TensorFlow's import dominates RSS, so the increase of the peak over the RSS
measured right after the model and train step were built is reported too.
The first column of memory ("tensors") is the peak of TensorFlow's own
allocator over the timed steps (`tf.config.experimental.get_memory_info` on
the accelerator, else on the CPU): the memory training itself needs, which
is what decides the batch on an accelerator.

A step is a full train step: forward, (clipped) gradient sum, noise and the
optimizer update, i.e. `PrivateTrainStep.accumulate` + `apply` with one
physical batch per logical step (`NonPrivateTrainStep` for "nonprivate").
Its two phases are timed too, and a second table reports the private
step's overhead twice: per physical batch (`accumulate`: per-example
clipping) and per logical step (`apply`: the noise, drawn once per logical
step, and the update), the latter also amortised over the 64 or 256
physical batches per logical step of large-batch training.

With `--memory_budget_mb=M` the bench instead searches, for every method,
the largest physical batch whose peak memory fits in M MiB (`search`).

A child that fails (killed by the OOM killer, out of accelerator memory,
timed out) is reported with a message naming a smaller batch or another
method, never silently.

Modules, each importing only those below it:

- `cli`: the flags and `main` (`python -m tfdp.bench`, `__main__`).
- `search`: the memory search, its driver and its child.
- `runners`: a method's step timed in a child, alone or paired with
  non-private training.
- `tables`: the ratios against non-private training and the text tables.
- `children`: the child processes' command line, result lines and failure
  messages.
- `models`: the bench's models and their train steps.

No module imports TensorFlow at module level; only the child processes do.

Two standalone benchmarks of private fine-tuning (docs/FINETUNING.md), each
run as a module, import TensorFlow when run:

- `finetune_step_time`: a private step under full fine-tuning, LoRA and
  BiTFiT (`python -m tfdp.bench.finetune_step_time`);
- `cached_head`: the head trained through a frozen backbone against on its
  cached features (`python -m tfdp.bench.cached_head`).
"""
