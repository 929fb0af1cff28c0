"""`SecretKey`: the secret randomness of a private run (noise and sampling).

The ε a run prints holds against an adversary who knows the code, the
configuration, every flag, the released model and whatever the run writes,
but not the training data and not this key. So the key:
- comes from the operating system's entropy (`secrets`, 128 bits) when a run
  starts afresh, never from `--seed`, `keras.utils.set_random_seed` or
  `tf.random.set_seed`;
- is stored only in training checkpoints, which are as private as the data,
  so that a resumed run continues with the same noise and batches;
- never appears in a config, a log, TensorBoard, `summary.json` or an
  exported model. `repr` and `str` do not show it.

`SecretKey.insecure_from_seed(seed)` derives the key from a public seed, for
tests and reproducible research only. It warns each time it is used, and a
run that uses it records that its guarantee does not hold against anyone who
knows the seed.

Imports no TensorFlow: sub-keys are plain `int64[2]` arrays, usable as
stateless seeds (`tf.random.stateless_*`) by the noise and the samplers.
"""

import hashlib
import secrets
import warnings

import numpy as np

KEY_BITS = 128

INSECURE_WARNING = (
    "INSECURE: the DP noise and sampling are derived from the public seed {seed}. "
    "Anyone who knows it can subtract the noise and knows the sampled batches: "
    "no epsilon holds against them. Use this for tests and reproducible research only."
)


class SecretKey:
    """128 secret bits from which the noise and sampling streams are derived.

    Args:
        words: sequence of two int64 values (the key's 128 bits). Use
            `SecretKey.generate()` for a fresh key, or a value restored from a
            checkpoint.
        insecure_seed: int or None. The public seed the key was derived from
            (`insecure_from_seed`), or None for a secret key. Defaults to None.
    """

    def __init__(self, words, *, insecure_seed=None):
        words = np.asarray(words, dtype=np.int64).reshape(-1)
        if words.shape != (2,):
            raise ValueError(
                "A SecretKey holds two int64 words (128 bits). "
                f"Received: an array of shape {words.shape}"
            )
        self._words = words
        self.insecure_seed = None if insecure_seed is None else int(insecure_seed)

    @classmethod
    def generate(cls):
        """A fresh key from the operating system's entropy."""
        bits = secrets.randbits(KEY_BITS)
        raw = bits.to_bytes(KEY_BITS // 8, "little")
        return cls(np.frombuffer(raw, dtype="<i8").copy())

    @classmethod
    def insecure_from_seed(cls, seed):
        """A key that is a public function of `seed`. Warns: not private."""
        if isinstance(seed, bool) or int(seed) != seed:
            raise ValueError(f"The insecure seed must be an integer. Received: seed={seed!r}")
        warnings.warn(INSECURE_WARNING.format(seed=seed), stacklevel=2)
        digest = hashlib.blake2b(f"tfdp-insecure-seed:{int(seed)}".encode(), digest_size=16)
        return cls(np.frombuffer(digest.digest(), dtype="<i8").copy(), insecure_seed=seed)

    @classmethod
    def resolve(cls, secret_key=None, insecure_seed=None):
        """The key given, the insecure key of `insecure_seed`, or a fresh one.

        Args:
            secret_key: `SecretKey` or None.
            insecure_seed: int or None. See `insecure_from_seed`.
        """
        if secret_key is not None and insecure_seed is not None:
            raise ValueError(
                "Pass a secret key or an insecure seed, not both. "
                f"Received: secret_key=<SecretKey>, insecure_seed={insecure_seed}"
            )
        if secret_key is not None:
            if not isinstance(secret_key, SecretKey):
                raise ValueError(
                    "secret_key must be a tfdp SecretKey (its value is never passed "
                    f"around as a plain number). Received: {type(secret_key).__name__}"
                )
            return secret_key
        if insecure_seed is not None:
            return cls.insecure_from_seed(insecure_seed)
        return cls.generate()

    @property
    def is_secret(self):
        """False when the key was derived from a public seed."""
        return self.insecure_seed is None

    @property
    def words(self):
        """The key's two int64 words: for checkpoints only."""
        return self._words.copy()

    def derive(self, purpose):
        """An independent sub-key `int64[2]` for one use (a stateless seed).

        Args:
            purpose: str. E.g. "noise" or "sampling"; distinct purposes give
                independent streams.
        """
        digest = hashlib.blake2b(
            self._words.tobytes() + purpose.encode(), digest_size=16, person=b"tfdp-subkey"
        )
        return np.frombuffer(digest.digest(), dtype="<i8").copy()

    def __eq__(self, other):
        return isinstance(other, SecretKey) and bool(np.all(self._words == other._words))

    def __hash__(self):
        return hash(self._words.tobytes())

    def __repr__(self):
        if self.is_secret:
            return "SecretKey(<secret>)"
        return f"SecretKey(insecure_seed={self.insecure_seed})"

    __str__ = __repr__
