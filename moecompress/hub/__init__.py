"""The Hugging Face Hub side of an output: the model card (:mod:`.card`) and ``moecompress push``
(:mod:`.push`). Downloading a checkpoint is :mod:`moecompress.io.hub`."""
