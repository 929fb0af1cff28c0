"""`import_tensorflow`: TensorFlow's import without its C++ start-up lines.

On a machine without a GPU, TensorFlow's C++ code writes lines such as
`failed call to cuInit: ... UNKNOWN ERROR (303)`, the oneDNN banner and
`Could not find cuda drivers` straight to file descriptor 2, before Python
can configure any logging, and `TF_CPP_MIN_LOG_LEVEL` no longer silences
them (absl's logging prints everything before its initialisation). A CPU
user can act on none of them. So the command-line tools import TensorFlow,
and let it find its devices, with descriptor 2 sent to a temporary file,
then replay every line that is not one of these known start-up notices.
"""

import os
import re
import sys
import tempfile

# Start-up notices that carry no action for the user.
_STARTUP_NOTICES = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called"
    r"|port\.cc:\d+\] oneDNN custom operations are on"
    r"|cudart_stub\.cc:\d+\] Could not find cuda drivers"
    r"|cuda_platform\.cc:\d+\] failed call to cuInit"
    r"|cuda_executor\.cc:\d+\] .*(?:No CUDA|cuInit)"
    r"|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized"
    r"|^To enable the following instructions: .* rebuild TensorFlow"
)


def is_startup_notice(line):
    """Whether `line` is one of TensorFlow's start-up notices (dropped)."""
    return bool(_STARTUP_NOTICES.search(line))


def import_tensorflow():
    """Imports TensorFlow and lists its devices, keeping only lines that matter.

    Does nothing once TensorFlow is imported. Python exceptions are raised as
    usual; every captured line that is not a known start-up notice is
    written to stderr afterwards.

    Returns:
        The `tensorflow` module.
    """
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # No descriptor 2 to redirect (e.g. a closed stderr).
        import tensorflow

        return tensorflow
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow

            tensorflow.config.list_physical_devices()  # Where cuInit runs.
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines()
                    if line.strip() and not is_startup_notice(line)]
            if kept:
                print("\n".join(kept), file=sys.stderr, flush=True)
    return tensorflow
