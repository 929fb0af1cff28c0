"""A compiled CPU op for the noise's Box–Muller draw, built once per machine.

On a CPU, TensorFlow computes Philox one block at a time, and the Box–Muller
transform is a dozen elementwise ops, each a pass over memory. For
ResNet-18's 11.2 M normals that took 45–100 ms per logical step on 2 cores,
half of a non-private step at 32 px. `native_noise.cc` computes the same
draw, eight Philox blocks per vector and the transform in registers, in
about a third of that time (docs/BENCHMARKS.md, eighth pass).

The op is `noise._normal_halves`'s draw, not another sampler: the words are
TensorFlow's own Philox words for the same seed (tested word for word), and
the values are the same Box–Muller pairs to float32 rounding (closer to
the exact values than TensorFlow's ops get). So a run that moves between
this op and TensorFlow's ops outside XLA draws the same noise up to
rounding. Under XLA, TensorFlow's stateless ops order the Philox stream
differently: the same law, other values.

It is used where all of these hold, and TensorFlow's ops are used elsewhere:
- the step draws at least `MIN_NORMALS` normals (2¹⁹);
- `TFDP_NATIVE_NOISE` is not `off` (`require` turns a build failure into an
  error, for tests and benchmarks that must measure this op);
- no GPU or TPU is visible (the noise must stay on the accelerator there);
- the draw is not inside an XLA-compiled function (XLA cannot compile it);
- a C++ compiler is found (`$CXX`, else `c++`, `g++` or `clang++`), the op
  builds against the installed TensorFlow, and the build uses AVX2 or
  AVX-512 (x86-64). Without them the op was slower than TensorFlow's ops
  (91 ms for ResNet-18's draw without, 34 ms with AVX2 and 11 ms with
  AVX-512, on this project's 2-core machine), so other CPUs, ARM included,
  keep TensorFlow's ops.

The library is cached under `$TFDP_CACHE_DIR` (default `~/.cache/tfdp`),
keyed by the source, TensorFlow's version, the compiler and the CPU's
features, so a shared home directory serves different machines.
"""

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
import time

import tensorflow as tf

_SOURCE = pathlib.Path(__file__).with_name("native_noise.cc")
_ENV = "TFDP_NATIVE_NOISE"
_MODES = ("auto", "off", "require")
_BUILD_TIMEOUT_S = 300
# -fno-math-errno lets sqrtf be one vector instruction (no input is negative).
_CXXFLAGS = ("-std=c++17", "-O3", "-fno-math-errno", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state = {"module": None, "error": None, "tried": False, "isa": None}
_logger = logging.getLogger(__name__)


def mode():
    """`TFDP_NATIVE_NOISE`: "auto" (the default), "off" or "require"."""
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value in ("0", "false", "no"):
        value = "off"
    if value not in _MODES:
        raise ValueError(
            f"{_ENV} must be one of {', '.join(_MODES)}. Received: {_ENV}={value!r}."
        )
    return value


def _cpu_features():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _compiler():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir():
    root = os.environ.get("TFDP_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tfdp"
    )
    return pathlib.Path(root) / "native"


def _library_path(compiler):
    """The cached library for this source, TensorFlow, compiler and CPU."""
    tag = hashlib.sha256(
        "\n".join(
            [_SOURCE.read_text(), tf.__version__, compiler, _cpu_features(), *_CXXFLAGS,
             *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
        ).encode()
    ).hexdigest()[:20]
    return _cache_dir() / f"native_noise_{tag}.so"


def _build(compiler):
    """Compiles the op into the cache (if not there yet); returns its path."""
    library = _library_path(compiler)
    if library.exists():
        return library
    cache = library.parent
    cache.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # A temporary name, then a rename: processes that build at once (bench
    # subprocesses, parallel tests) never load a half-written library.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    base = [compiler, *_CXXFLAGS, str(_SOURCE), "-o", partial,
            *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    try:
        result = None
        # -march=native lets the op use the CPU's vector width; compilers
        # that do not know it get the generic build.
        for arch in (["-march=native"], []):
            result = subprocess.run(base[:1] + arch + base[1:], capture_output=True, text=True,
                                    timeout=_BUILD_TIMEOUT_S)
            if result.returncode == 0:
                break
        if result.returncode != 0:
            raise RuntimeError(
                f"{compiler} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}"
            )
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    _logger.info("tfdp: built the native noise op in %.1f s: %s",
                 time.perf_counter() - started, library)
    return library


def load():
    """The loaded op module, building it if needed; None if it cannot be had.

    Raises:
        RuntimeError: in `require` mode, when the op cannot be built or loaded.
    """
    current = mode()
    if current == "off":
        return None
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            compiler = _compiler()
            try:
                if compiler is None:
                    raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
                library = _build(compiler)
                module = tf.load_op_library(str(library))
                isa = ctypes.CDLL(str(library)).TfdpNativeNoiseIsa
                isa.restype = ctypes.c_char_p
                _state["isa"] = isa().decode()
                if _state["isa"] == "generic":
                    # Measured: 91 ms for 11.2 M normals, against 45-60 ms for
                    # TensorFlow's ops and 10-12 ms with AVX-512.
                    _state["error"] = (
                        "the compiler targets neither AVX2 nor AVX-512, where the op is "
                        "slower than TensorFlow's ops")
                    _logger.info("tfdp: not using the native noise op: %s.", _state["error"])
                else:
                    _state["module"] = module
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError,
                    tf.errors.OpError) as error:
                _state["error"] = f"{type(error).__name__}: {error}"
                _logger.warning(
                    "tfdp: the native noise op is unavailable, so the noise is drawn with "
                    "TensorFlow ops (about 3x slower on a CPU; set %s=off to silence this). "
                    "Cause: %s", _ENV, _state["error"])
    if _state["module"] is None and current == "require":
        raise RuntimeError(
            f"{_ENV}=require, but the native noise op could not be built or loaded. "
            f"Cause: {_state['error']}"
        )
    return _state["module"]


def _in_xla_context():
    # Internal API: a jit_compile tf.function traces inside an XLA context,
    # which XLA would fail to compile with a custom op in it.
    from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _accelerator_visible():
    return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))


# Fewer normals per step than this keep TensorFlow's ops, and never build
# the op: the build (about 8 s, once per machine) would cost more than the op
# saves (about 3 ns a normal on 2 cores, so 1.6 ms a step at this size). The
# default run's 26,106 parameters stay below it; ResNet-18's 11.2 M do not.
MIN_NORMALS = 2**19


def usable_here(num_normals=None):
    """Whether a draw traced or run now would use the op (see the module doc).

    Args:
        num_normals: int or None. The normals of the whole step's noise; below
            `MIN_NORMALS` the op is not used. None skips that check.
    """
    if num_normals is not None and num_normals < MIN_NORMALS:
        return False
    if mode() == "off" or _accelerator_visible() or _in_xla_context():
        return False
    return load() is not None


def normal_halves(half, seed, stddev):
    """The sin and cos halves of one draw: float32 [half] each, N(0, stddev²).

    The same draw as `noise._normal_halves` makes with TensorFlow's ops. Call
    only where `usable_here()` is true.

    Args:
        half: int. Pairs in the draw.
        seed: tensor [2]. The draw's stateless seed.
        stddev: float or scalar tensor.
    """
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.cast(seed, tf.int64))
    halves = load().tfdp_normal_halves(key, counter, tf.cast(stddev, tf.float32), pairs=int(half))
    return halves[0], halves[1]


def noisy_divided(grads, *, keys, counters, stddev, divisor, piece_draw, piece_pairs,
                  piece_offset, piece_start, piece_size):
    """(grads + noise) / divisor for one float32 tensor, in one pass.

    `noise._native_noisy_divided` builds the arguments; see `TfdpNoisyDivided`
    in native_noise.cc. Call only where `usable_here()` is true.
    """
    return load().tfdp_noisy_divided(
        grads, keys, counters, stddev, divisor, piece_draw=piece_draw, piece_pairs=piece_pairs,
        piece_offset=piece_offset, piece_start=piece_start, piece_size=piece_size,
    )


def instruction_set():
    """"avx512", "avx2" or "generic" for the loaded build; None before one is built."""
    return _state["isa"]
