"""Commands that use an output: ``moecompress inspect`` (:mod:`.inspect`) and ``moecompress eval``
(:mod:`.evaluation`)."""
