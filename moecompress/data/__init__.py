"""Models bundled with the package, named ``moecompress:NAME`` (see :mod:`moecompress.io.hub`)."""
