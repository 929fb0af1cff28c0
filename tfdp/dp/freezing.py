"""Freezing what the per-layer clipping cannot see, before a private run.

`freeze_unclippable` is the engine's answer to "which layers of this model
must not train": tied weights that the tapped methods refuse, variables no
leaf layer owns, and optionally the layers on chosen rules. Fine-tuning
(`tfdp.models.load_pretrained`) calls it after building the model.
"""

from tfdp.dp import layer_taps
from tfdp.dp import model_probe
from tfdp.dp import rules
from tfdp.dp import tapped_clipping


def _layers_with_paths(model, path=""):
    """Yields (path, layer) for every layer under `model`, sublayers included.

    The path joins the layer names with `/`: the sublayers of different
    attention blocks share names, their paths do not.
    """
    for layer in model._flatten_layers(include_self=False, recursive=False):
        layer_path = f"{path}/{layer.name}" if path else layer.name
        yield layer_path, layer
        yield from _layers_with_paths(layer, layer_path)


def freeze_unclippable(model, freeze_rules=()):
    """Freezes the layers whose weights the per-layer clipping cannot see.

    It asks the clipping engine, on the model's declared input:
    - which trainable variables are read by a layer other than their owner
      (tied weights; `model_probe`): the tapped methods refuse them, so
      their owners are frozen;
    - which trainable variables no leaf layer owns
      (`tapped_clipping.uncovered_variables`): those variables are frozen;
    - with `freeze_rules`, which layers the registry gives one of those
      rules (`rules.rule_for`), e.g. `("generic",)` for every layer clipped
      only through per-example VJPs, as Bu et al. 2022 froze the modules
      their engine did not support.

    A layer that mixes examples cannot be made private by freezing (its
    outputs carry other examples' data into every later layer), so it is an
    error here as in training.

    Args:
        model: keras.Model. A built model with a declared input; no
            trainable BatchNorm (`tfdp.models.replace_batchnorm` or
            `freeze_batchnorm` first).
        freeze_rules: tuple of str. Rule names (`dp.plan`'s "kind") whose
            layers are frozen too. Defaults to `()`.

    Returns:
        list of str: what was frozen, each as `"path (reason)"`.

    Raises:
        ValueError: if a layer mixes examples, or the model has a trainable
            BatchNorm.
    """
    frozen = []
    by_name = {}
    for path, layer in _layers_with_paths(model):
        by_name.setdefault(layer.name, []).append((path, layer))
    report = model_probe.probe(model)
    if report is not None:
        report.refuse_mixing()
        report.refuse_state_writes()
        for read in report.foreign_reads:
            for path, layer in by_name.get(read.owner, ()):
                if layer.trainable:
                    layer.trainable = False
                    frozen.append(f"{path} (variable {read.variable} read by '{read.reader}')")
    for variable in tapped_clipping.uncovered_variables(model):
        variable.trainable = False
        frozen.append(f"{variable.path} (owned by no leaf layer)")
    if freeze_rules:
        for path, layer in _layers_with_paths(model):
            if not layer_taps.own_trainable_variables(layer):
                continue
            rule = rules.rule_for(layer).name
            if rule in freeze_rules:
                layer.trainable = False
                frozen.append(f"{path} (rule {rule!r})")
    return frozen
