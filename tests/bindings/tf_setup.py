"""TensorFlow as the binding tests run it inside each rank: quiet, few threads (2 cores), float64 Keras.

The TensorFlow files' bodies share their jobs (``mpi_test(pool=TF_POOL)``, tests/mpi/pool.py), and
TensorFlow takes its thread counts only before its first op: every such body asks for the same
ones, here, first thing, and a later body in the same process finds them set. A body that needs
other counts (test_tf_graph_names.py) runs in its file's own jobs.
"""
import os

TF_POOL = "tensorflow"
INTRA_OP_THREADS = 1
INTER_OP_THREADS = 2


def setup_threads():
    """tf, quiet and with the binding tests' thread counts; call it first thing inside the rank."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    threading = tf.config.threading
    if threading.get_intra_op_parallelism_threads() != INTRA_OP_THREADS:
        threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
    if threading.get_inter_op_parallelism_threads() != INTER_OP_THREADS:
        threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    return tf


def setup_tensorflow():
    """(tf, keras) configured for a test body, Keras in float64; call it first thing inside the rank."""
    tf = setup_threads()
    import keras
    keras.config.set_floatx("float64")
    return tf, keras
