"""TensorFlow as the binding tests run it inside each rank: quiet, few threads (2 cores), float64 Keras."""
import os


def setup_tensorflow():
    """(tf, keras) configured for a test body; call it first thing inside the rank."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    keras.config.set_floatx("float64")
    return tf, keras
