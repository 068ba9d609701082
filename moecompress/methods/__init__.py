"""Method maths as pure tensor functions, free of engine types (no PassConfig, LayerStats, PassSpec):
width selection for neuron pruning, k-means, scalar quantisation, rotations, CodeQuant's codebooks,
whitening, Tucker and SVD, expert merging (Nash solver, clustering, alignment) and metrics. Passes in
:mod:`moecompress.passes` call them; an infeasible setting raises :class:`~moecompress.errors.MethodError`."""
