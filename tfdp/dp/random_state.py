"""The random state of a model's training pass, to hold fixed between passes.

A probe compares passes that must draw the same random values (dropout,
augmentation, noise): `RandomState` snapshots and restores everything a
training pass draws from, and `generators` finds the `tf.random.Generator`s
a model's layers hold.
"""

import random

import keras
import numpy as np
import tensorflow as tf
from keras.src.random import seed_generator as keras_seed_generator


class RandomState:
    """What a training pass of a model may change, to restore between passes.

    The model's non-trainable variables (the Keras seed generators' states
    among them, and any state a pass writes), the state of every
    `tf.random.Generator` its layers hold, of TensorFlow's global generator
    and of Keras' global seed generator (which `keras.random` draws from
    without a seed), and numpy's and Python's global generators (which code
    that is traced may draw from). `snapshot` takes them; `restore` puts them back, so that
    the passes after it draw the same random values.

    Args:
        model: keras.Model.
    """

    def __init__(self, model):
        states = [g.state for g in generators(model)]
        seed_generators = held_objects(model, keras.random.SeedGenerator)
        if not tf.distribute.has_strategy():
            # Keras' global one, which `keras.random` draws from without a seed;
            # made with a draw from Python's generator, which is put back.
            python_state = random.getstate()
            seed_generators.append(keras_seed_generator.global_seed_generator())
            random.setstate(python_state)
        own = {id(v) for v in model.non_trainable_variables}
        states += [g.state for g in seed_generators if id(g.state) not in own]
        self.variables = list(model.non_trainable_variables) + states
        # The variables that hold random state, which moves the same way
        # whatever the data: the generators' and the Keras seed generators'.
        self.random_ids = {id(v) for v in states} | {id(g.state) for g in seed_generators}
        self.initial = self.snapshot()

    def snapshot(self):
        """The current values: `(variable values by id, numpy's state, Python's state)`."""
        return ({id(v): v.numpy() for v in self.variables}, np.random.get_state(),
                random.getstate())

    def restore(self, snapshot=None):
        """Puts back `snapshot` (defaults to the values when this was made)."""
        values, numpy_state, python_state = snapshot or self.initial
        for v in self.variables:
            v.assign(values[id(v)])
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def generators(model):
    """The `tf.random.Generator`s that `model`'s layers hold, and the global one.

    A generator is found as an attribute of a layer (or of the model), or in
    a list, tuple or dict held by one. The global generator is created here
    if it does not exist yet (outside a distribution strategy), so that a
    layer drawing from it draws from a state that can be restored.

    Args:
        model: keras.Model.

    Returns:
        list of `tf.random.Generator`.
    """
    found = held_objects(model, tf.random.Generator)
    if not tf.distribute.has_strategy():
        generator = tf.random.get_global_generator()
        if all(g is not generator for g in found):
            found.append(generator)
    return found


def held_objects(model, kind):
    """The objects of type `kind` that `model`'s layers hold.

    An object is found as an attribute of a layer (or of the model), or in a
    list, tuple or dict held by one (nested up to three deep).

    Args:
        model: keras.Model.
        kind: type. The class of the objects to find.

    Returns:
        list of the objects found, each once.
    """
    found = {}

    def visit(value, depth):
        if isinstance(value, kind):
            found.setdefault(id(value), value)
        elif depth < 3 and isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)

    for layer in model._flatten_layers(include_self=True, recursive=True):
        for value in vars(layer).values():
            visit(value, 0)
    return list(found.values())
