"""The bench's models and their train steps.

`MODELS` names the `tfdp.models` builders the bench can time; `build_step`
pairs one with the train step of a method: `dp.NonPrivateTrainStep` for
"nonprivate", else `dp.PrivateTrainStep` with a `DPSGD` mechanism (its noise
hardened with `--hardened_noise`).

Imports no TensorFlow at module level: only the bench's child processes
build models, and the parent (which spawns them) and `--help` never do.
"""

import os

MODELS = (
    "resnet18", "resnet34", "resnet50", "small_convnet", "vgg_cifar",
    "vit_ti16", "vit_s16", "vit_b16",
    # keras.applications backbones with GroupNorm (16 groups) in place of BatchNorm.
    "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "densenet121",
)


def build_model(name, image_size, channels, num_classes):
    """Builds one of `MODELS` (the `tfdp.models` builder of that name) for square inputs."""
    # Here, not at the top: keeps TensorFlow out of the parent process and --help.
    from tfdp import models

    if name not in MODELS:
        raise ValueError(f"Unknown bench model. Expected one of {MODELS}. Received: name={name!r}")
    shape = (image_size, image_size, channels)
    return getattr(models, name)(num_classes=num_classes, input_shape=shape)


def build_step(args):
    """The model and its (private or non-private) train step for `args`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    # Here, not at the top: keeps TensorFlow out of the parent process and
    # --help, and Keras reads the environment set just above.
    import keras

    from tfdp import dp
    from tfdp.dpsgd_config import DPSGDConfig
    from tfdp.engine import make_engine

    method = args.child_method
    jit = args.child_jit == "on"
    keras.utils.set_random_seed(0)
    model = build_model(args.model, args.image_size, args.channels, args.num_classes)
    optimizer = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9, nesterov=True)

    def loss_fn(y_true, logits):
        return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)

    if method == "nonprivate":
        step = dp.NonPrivateTrainStep(
            model, optimizer, loss_fn, expected_batch_size=args.batch_size * args.virtual_steps,
            weight_decay=args.weight_decay, jit_compile=jit,
        )
    else:
        engine = make_engine(
            DPSGDConfig(args.l2_norm_clip, args.noise_multiplier,
                        hardened_noise=args.hardened_noise), sampler=None, key=None,
            expected_batch_size=args.batch_size * args.virtual_steps)
        step = dp.PrivateTrainStep(
            model, optimizer, loss_fn, engine=engine, method=method,
            weight_decay=args.weight_decay, jit_compile=jit,
        )
    return model, step
