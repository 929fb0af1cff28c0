"""`RunConfig`: how the trainer executes, logs, checkpoints and reports a run."""

import dataclasses

import gin

from tfdp import validation


@gin.configurable(module="tfdp.training")
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How a run is computed and what it writes, none of which changes what it learns.

    The physical batch, padding, strategy and precision decide how a
    logical batch is computed; the rest, what is evaluated, logged and
    written.

    Args:
        physical_batch_size: int or None. Examples per accelerator pass;
            virtual steps make up the logical batch. With a strategy of
            several replicas it is global, split over them. Defaults to
            None: the logical batch (k times it under
            `PrivacyConfig.privacy_unit="user"`).
        pad_granule: int, "auto" or None. Poisson steps are padded to a
            multiple of this divisor of the physical batch only, their last
            physical batch being shorter (`tfdp.data.make_train_pipeline`);
            None pads to whole physical batches. With several replicas the
            physical batches stay whole. Defaults to "auto" (P / 8).
        strategy: str. tf.distribute strategy: "one_device", "mirrored",
            "multi_worker_mirrored" or "tpu" (docs/DISTRIBUTED.md); the
            `--strategy` flag overrides it. Defaults to "one_device".
        jit_compile: bool. XLA for the physical step. Defaults to False.
        mixed_precision: bool. Keras "mixed_bfloat16" (bf16 compute, float32
            variables; losses, norms, clipped sums and noise in float32).
            Defaults to False.
        eval_batch_size: int. Examples per evaluation pass. Defaults to 500.
        train_eval_examples: int. Training examples evaluated per epoch for
            the train loss/accuracy. Defaults to 2000.
        log_every_steps: int. Progress line period. Defaults to 50.
        checkpoint_every_steps: int or None. Checkpoint period in steps.
            Defaults to None: once per epoch.
        export_model: bool. Save `model.keras` and a SavedModel at the end.
            Defaults to True.
        write_html_report: bool. Write `report.html` (the run's plots,
            `tfdp.report`) into the workdir at the end. Defaults to True.
        report_non_dp_statistics: bool. Compute, print and log the figures
            that come from the training data without noise, and so are NOT
            covered by epsilon: the train loss and accuracy, the mean
            per-example gradient norm, the clipped fraction and the counts of
            non-finite and undecodable training examples. They are labelled
            "not covered by epsilon" wherever they appear (the `non_dp/`
            TensorBoard tags, `summary.json`'s `not_covered_by_epsilon`).
            False turns them all off. The exact sizes of the splits (N, the
            validation and test counts) stay, labelled the same way: the
            accounting needs N (q = B/N). Defaults to True.
    """

    physical_batch_size: object = None
    pad_granule: object = "auto"
    strategy: str = "one_device"
    jit_compile: bool = False
    mixed_precision: bool = False
    eval_batch_size: int = 500
    train_eval_examples: int = 2000
    log_every_steps: int = 50
    checkpoint_every_steps: object = None
    export_model: bool = True
    write_html_report: bool = True
    report_non_dp_statistics: bool = True

    def __post_init__(self):
        for name, least, optional in (("physical_batch_size", 1, True),
                                      ("eval_batch_size", 1, False),
                                      ("train_eval_examples", 0, False),
                                      ("log_every_steps", 1, False),
                                      ("checkpoint_every_steps", 1, True)):
            value = getattr(self, name)
            if optional and value is None:
                continue
            if not validation.is_int(value) or value < least:
                raise ValueError(
                    f"{name} must be an integer >= {least}"
                    + (" or None" if optional else "") + f". Received: {name}={value!r}")
